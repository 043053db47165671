"""Decoding speed of the translation example with and without the decoder's key/value cache, greedy and beam 4.

Translates the first ``--rows`` English sentences of a Multi30k JSON Lines split into German in batches of 32
(as ``train.py predict`` does), in one process on one torch thread, with the weights of ``--ckpt`` (a
``train.py fit`` checkpoint; without one, a freshly initialised model of the CPU config, whose translations
run to the length limit). Each configuration (greedy or beam, cache or not) runs once per repeat, interleaved;
the figure is generated tokens (up to and including ``</s>``) per second, median over the repeats, and the
cached configurations' speed-up over the uncached ones. Cached and uncached translations are checked to be equal.

Usage::

    python benchmarks/translation_decode.py --ckpt PATH.ckpt --data DIR/test_2016_flickr.jsonl  # DIR: prepare.py's
    python benchmarks/translation_decode.py --rows 64 --repeats 3 --beams 1
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from translation.data import TranslationDataModule  # noqa: E402
from translation.decoding import beam_search, greedy  # noqa: E402
from translation.module import TranslationModule  # noqa: E402

DEFAULT_DATA = REPO / "examples" / "translation" / "data" / "validation.jsonl"


def main() -> None:
    """Run the interleaved measurements and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", help="a train.py checkpoint (default: a fresh model of configs/cpu.yaml)")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="JSON Lines with en and de columns")
    parser.add_argument("--rows", type=int, default=128, help="sentences to translate (default 128)")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4], help="beam sizes (1: greedy)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.ckpt:
        module = TranslationModule.load_from_checkpoint(args.ckpt, map_location="cpu")
    else:
        module = TranslationModule()
    module.eval()
    with open(args.data, encoding="utf-8") as f:
        sentences = [json.loads(line)["en"] for line, _ in zip(f, range(args.rows))]
    batches = [batch["src"] for batch in TranslationDataModule(predict_sentences=sentences).predict_dataloader()]
    print(f"python benchmarks/translation_decode.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; torch {torch.__version__}")
    configs = [(beam, cache) for beam in args.beams for cache in (False, True)]
    rates: dict[tuple[int, bool], list[float]] = {config: [] for config in configs}
    outputs: dict[tuple[int, bool], list[list[int]]] = {}
    ends = dict(bos=module.tokenizer.bos_token_id, eos=module.tokenizer.eos_token_id, max_new_tokens=16)
    for repeat in range(args.repeats):
        for beam, cache in configs:
            started, translations = time.perf_counter(), []
            with torch.no_grad():
                for src in batches:
                    if beam == 1:
                        translations += greedy(module.backbone, src, cache=cache, **ends)
                    else:
                        translations += beam_search(module.backbone, src, beam_size=beam, cache=cache, **ends)
            seconds = time.perf_counter() - started
            tokens = sum(len(ids) + 1 for ids in translations)
            rates[beam, cache].append(tokens / seconds)
            outputs[beam, cache] = translations
            name = f"beam {beam}" if beam > 1 else "greedy"
            print(f"repeat {repeat + 1}  {name:<7} cache={cache!s:<5} {tokens / seconds:8.1f} tokens/s"
                  f"  ({tokens} tokens, {seconds:.1f} s)", flush=True)  # fmt: skip
    print()
    print(f"{'decoding':<8} {'cache':<6} {'tokens/s (median)':>18}   repeats")
    for beam, cache in configs:
        name = f"beam {beam}" if beam > 1 else "greedy"
        cells = ", ".join(f"{rate:.1f}" for rate in rates[beam, cache])
        print(f"{name:<8} {cache!s:<6} {statistics.median(rates[beam, cache]):>18.1f}   {cells}")
    for beam in args.beams:
        speedup = statistics.median(rates[beam, True]) / statistics.median(rates[beam, False])
        same = outputs[beam, True] == outputs[beam, False]
        name = f"beam {beam}" if beam > 1 else "greedy"
        print(f"{name}: cache speed-up {speedup:.2f}x; cached translations equal uncached: {same}")
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
