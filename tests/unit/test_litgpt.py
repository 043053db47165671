"""litgpt's ``GPT`` in the pipeline (lightning_gpipe.litgpt), in one process: the cut equals ``GPT.forward`` exactly
for a Pythia and a Llama config, without a weight copied; the self-check names the layer that differs; a one-stage
pipeline decodes as litgpt's ``generate``; a stage reads only its own tensors of a ``lit_model.pth``; ``CausalLM``
builds from a litgpt checkpoint directory. The multi-stage runs: tests/distributed/test_litgpt.py.
"""

import pytest
import torch
from conftest import one_stage_pipeline, worker_module

pytest.importorskip("litgpt")

from litgpt.config import Config  # noqa: E402
from litgpt.generate.base import generate  # noqa: E402
from litgpt.model import GPT  # noqa: E402

import lightning_gpipe.litgpt as lg  # noqa: E402
from lightning_gpipe.engine import materialize  # noqa: E402

WORKER = worker_module("litgpt_models.py")


@pytest.mark.parametrize("config", list(WORKER.CONFIGS))
def test_the_cut_computes_gpt_forward_exactly_and_holds_the_models_own_tensors(config):
    model = WORKER.initial_model(config)
    backbone = lg.to_sequential(model)
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(backbone(ids), model(ids))
    assert len(backbone) == model.config.n_layer + 3
    state = {lg.lit_name(k): v for k, v in backbone.state_dict(keep_vars=True).items()}
    assert state.keys() == model.state_dict().keys()  # litgpt's names: a lit_model.pth loads into the stages
    assert all(state[k] is v for k, v in model.state_dict(keep_vars=True).items())  # no copy


def test_a_layer_that_does_not_compute_the_models_forward_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(lg.FinalNorm, "forward", lambda self, value: value)
    with pytest.raises(lg.SelfCheckError, match=r"pythia-tiny.*transformer\.ln_f"):
        lg.check_cut(Config(**WORKER.CONFIGS["pythia"]))


@pytest.mark.parametrize("config", list(WORKER.CONFIGS))
def test_greedy_generation_through_a_one_stage_pipeline_equals_litgpt_generate(config, tmp_path):
    """Two prompts, a micro-batch each: each row is litgpt's ``generate`` (temperature 0) on its prompt alone, and
    every block's caches are freed after."""
    torch.save(WORKER.initial_model(config).state_dict(), tmp_path / "lit_model.pth")
    module = lg.CausalLM(WORKER.CONFIGS[config], checkpoint=tmp_path)
    module.configure_model()
    one_stage_pipeline(module, chunks=2, checkpoint="never")
    prompts = WORKER.prompts()
    generated = lg.greedy_generate(module.backbone, prompts, max_new_tokens=6)
    model = WORKER.initial_model(config).eval()
    model.max_seq_length = prompts.shape[1] + 6
    model.set_kv_cache(batch_size=1)
    for row, prompt in zip(generated, prompts):
        assert torch.equal(row, generate(model, prompt, prompts.shape[1] + 6, temperature=0.0))
    blocks = [m for m in module.backbone.modules() if isinstance(m, lg.Block)]
    assert blocks and all(b.kv_cache == {} and b.cache_length is None for b in blocks)


def test_greedy_generation_stops_when_every_row_has_produced_the_end_token():
    model = WORKER.initial_model("llama").eval()
    backbone = lg.to_sequential(model)
    prompts = WORKER.prompts()
    free = lg.greedy_generate(backbone, prompts, max_new_tokens=6)
    eos = int(free[0, prompts.shape[1] + 1])  # the first row's second new token
    stopped = lg.greedy_generate(backbone, prompts, max_new_tokens=6, eos_id=eos)
    ends = [row.tolist().index(eos, prompts.shape[1]) if eos in row[prompts.shape[1] :] else None for row in free]
    assert stopped.shape[1] <= free.shape[1]
    for row, end, whole in zip(stopped, ends, free):
        if end is None:
            assert torch.equal(row, whole[: len(row)])
        else:  # eos, then eos again after it
            assert torch.equal(row[: end + 1], whole[: end + 1]) and bool((row[end:] == eos).all())


def test_a_stage_reads_only_its_own_tensors_of_a_lit_model_pth_memory_mapped(tmp_path, monkeypatch):
    model = WORKER.initial_model("pythia")
    torch.save(model.state_dict(), tmp_path / "lit_model.pth")
    calls, names = [], []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or load(*a, **k))
    checkpoint = lg.LitCheckpoint(tmp_path)
    original = checkpoint.load
    checkpoint.load = lambda wanted, device: names.extend(wanted) or original(wanted, device)  # type: ignore[method-assign]
    with torch.device("meta"):
        meta = GPT(model.config)
    backbone = lg.to_sequential(meta, checkpoint, check=False)
    stage = torch.nn.Sequential(*list(backbone)[:2])  # the embedding and the first block
    materialize(stage, torch.device("cpu"))
    own = {lg.lit_name(k): v for k, v in stage.state_dict().items()}
    expected = [k for k in model.state_dict() if k.startswith(("transformer.wte.", "transformer.h.0."))]
    assert sorted(names) == sorted(own) == sorted(expected)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in own.items())
    assert all(t.is_meta for t in list(backbone)[2].parameters())  # another stage's layer: never allocated here
    assert calls == [dict(map_location="cpu", mmap=True, weights_only=True)]
    ids = torch.tensor([[1, 2]])  # the stage's rope tables, computed on it, are the model's
    assert torch.equal(
        stage(ids), model.transformer.h[0](model.transformer.wte(ids), model.cos[None, :2], model.sin[None, :2])
    )


def test_a_checkpoint_of_another_config_or_none_at_all_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="lit_model.pth"):
        lg.LitCheckpoint(tmp_path)
    torch.save(WORKER.initial_model("pythia").state_dict(), tmp_path / "lit_model.pth")
    with pytest.raises(KeyError, match=r"lit_model\.pth has no \['transformer\.h\.0\.mlp\.fc_1\.weight'"):
        lg.to_sequential(WORKER.initial_model("llama"), tmp_path)  # Pythia's MLP has no fc_1
    smaller = GPT(Config(**{**WORKER.CONFIGS["pythia"], "n_embd": 16}))
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight is \(100, 32\).*\(100, 16\)"):
        lg.to_sequential(smaller, tmp_path, check=False)


def test_causal_lm_builds_from_a_litgpt_checkpoint_directory_without_a_strategy(tmp_path):
    from litgpt.utils import save_config

    model = WORKER.initial_model("llama")
    torch.save({"model": model.state_dict()}, tmp_path / "lit_model.pth")  # litgpt's fine-tuning format
    save_config(model.config, tmp_path)
    module = lg.CausalLM(checkpoint=tmp_path, lr=1e-2)
    module.configure_model()  # no strategy: the whole model, materialised here
    ids = WORKER.batches()[0]
    assert torch.equal(module.backbone(ids), model(ids))
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="Give `model`"):
        lg.CausalLM()


def test_causal_lm_trains_a_gpt_given_in_place_without_registering_the_whole_model():
    model = WORKER.initial_model("pythia")
    module = lg.CausalLM(model)
    module.configure_model()
    assert module.gpt is model and "_gpt" not in module._modules  # only the backbone's layers are the module's
    assert {id(p) for p in module.parameters()} == {id(p) for p in model.parameters()}


def test_an_older_litgpt_is_refused_at_import_naming_the_fix(monkeypatch):
    import importlib
    import sys

    from lightning_utilities.core import imports

    installed = imports._version
    monkeypatch.setattr(imports, "_version", lambda name: "0.5.0" if name == "litgpt" else installed(name))
    for name in [name for name in sys.modules if name.startswith("lightning_gpipe.litgpt")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r'needs litgpt 0.5.13 or newer: pip install "lightning-gpipe\[litgpt\]"'):
        importlib.import_module("lightning_gpipe.litgpt")
