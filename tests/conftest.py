"""Shared fixtures: running a distributed worker script as K stage processes (alone, or sharing one launch with the
other scripts that need K, see :func:`shared_run`)."""

import os

# Threads that wait for work sleep rather than spin (libgomp's default spins first), in this process and in every
# process the tests start, which inherit it: the tests run processes side by side on two cores, where a spinning
# thread only takes a core from another process's work. Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from torchvision_cpu import make_importable

make_importable()  # timm imports torchvision: see tests/torchvision_cpu.py

WORKERS = Path(__file__).parent / "workers"

_RUNNING: set[subprocess.Popen] = set()
"""The main processes of :func:`run_worker`'s runs now running: what the session's end stops (SIGTERM: a job ends every
stage on it) where it ends before a run started beside the tests (:func:`beside`) did."""

_ENVIRONMENT = dict(os.environ)
"""The environment the session began with: what the shared launches started beside other tests give their workers
(an in-process test may change ``os.environ`` meanwhile, see :func:`_no_process_group_left`)."""


def run_worker(
    script: str, *args: str, timeout: float = 300, env: dict | None = None, inherit: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>``; Lightning's launcher starts the other stage processes from it."""
    process = start_worker(script, *args, env=env, inherit=inherit)
    _RUNNING.add(process)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    finally:
        _RUNNING.discard(process)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def started_environment() -> dict[str, str]:
    """The environment a process started now gets: ``os.environ`` on the main thread; in a thread beside the tests
    (:func:`beside`, :func:`concurrently`) the session's first (an in-process test may change ``os.environ``
    meanwhile, see :func:`_no_process_group_left`)."""
    return dict(os.environ if threading.current_thread() is threading.main_thread() else _ENVIRONMENT)


def start_worker(
    script: str,
    *args: str,
    env: dict | None = None,
    ignore_sigint: bool = False,
    inherit: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``tests/workers/<script>`` (the main process of its stages) and return at once, in the environment
    ``inherit`` (default :func:`started_environment`) updated with ``env``; ``ignore_sigint``
    starts it with SIGINT ignored, as a background job of a non-interactive shell is: ``sh`` ignores it and execs
    the script (the same pid, the disposition inherited), with no ``preexec_fn``, which is unsafe in a thread of
    :func:`concurrently`."""
    inherited = started_environment() if inherit is None else inherit
    environment = {
        k: v for k, v in inherited.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    environment.update(env or {})
    command = [sys.executable, str(WORKERS / script), *args]
    if ignore_sigint:
        command = ["/bin/sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)


def wait_for_file(path: Path, *processes: subprocess.Popen, within: float = 400) -> None:
    """Wait until a worker writes ``path`` (a handshake); if a process of ``processes`` ends first or ``within``
    seconds pass, kill them and fail with the first one's stderr."""
    import time

    deadline = time.time() + within
    while not path.exists():
        if any(process.poll() is not None for process in processes) or time.time() > deadline:
            for process in processes:
                process.kill()
            raise AssertionError(f"no {path.name}:\n" + processes[0].communicate()[1][-3000:])
        time.sleep(0.2)


def process_exits(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds: looked at until then, and at least
    once (a process already gone is gone, however long the run took)."""
    import time

    deadline = time.time() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.time() >= deadline:
            return False
        time.sleep(0.1)


def assert_every_stage_exits(out: Path, within: float = 60, since: float | None = None, processes: int = 2) -> None:
    """Assert the ``processes`` stage processes of a run are gone within ``within`` seconds of ``since`` (by default
    of this call, made once the run's main process has ended: how long the run took, which a busy machine decides,
    does not count; a run that hangs fails on its own timeout): each wrote its pid to ``rank{r}.txt`` in ``out``
    (tests/workers/failure.py, tests/workers/mesh.py, tests/workers/wrong_checkpoint.py)."""
    import time

    since = time.time() if since is None else since
    for rank in range(processes):
        pid = int((out / f"rank{rank}.txt").read_text())
        assert process_exits(pid, within=within - (time.time() - since)), f"rank {rank} is left"


def concurrently(jobs: dict, at_once: int = 2) -> dict:
    """Call the functions of ``jobs`` (each runs worker processes and waits for them) ``at_once`` at a time, in
    threads; return, by key, a function that gives the job's result or raises what it raised.

    A launch of stage processes keeps one core busy for most of its time: its main process imports Lightning (seconds)
    before the launcher starts the other processes, which import it too. Two launches side by side keep two cores
    busy, and each still runs, and is checked, exactly as alone.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(at_once) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
    return {key: future.result for key, future in futures.items()}


ROOT = Path(__file__).resolve().parents[1]
"""The repository."""

SHORT_EXAMPLE_RUNS = {
    "examples/amoebanet/train.py": [
        "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1", "--data.batch_size=8",
    ],
    "examples/translation/train.py": [
        "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--data.max_tokens=400", "--data.val_rows=2",
        "--model.max_new_tokens=2", "--trainer.log_every_n_steps=1",
    ],
}  # fmt: skip
"""Options that make a run of an example short (a few steps, each logged, tiny batches, one validation), appended to
its command line by the docs' command test and by the example's own test, which then share one run
(:func:`run_example`)."""

_EXAMPLE_RUNS: dict[tuple, tuple[subprocess.CompletedProcess, Path, Path]] = {}
"""The runs of :func:`run_example` so far, by command line (as :func:`_example_key` reads it)."""


def _example_key(script: str, args: tuple[str, ...]) -> tuple:
    """What a command line of ``script`` asks for: its other arguments in order, and the last value of each
    ``--key=value`` option (the one the command line parser keeps)."""
    options = dict(arg.split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)
    others = tuple(arg for arg in args if not (arg.startswith("--") and "=" in arg))
    return script, others, tuple(sorted(options.items()))


def run_example(script: str, *args: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """``python <script> ARGS`` (``script``: a path in the repository) with ``--trainer.default_root_dir=ROOT_DIR``,
    from an empty directory with no ``../shared`` beside it: ``(the result, that directory, ROOT_DIR)``.

    Run once per session for each command line that asks for the same (:func:`_example_key`): the docs' command test
    and the example's own test, each with its own assertions, read one run.
    """
    key = _example_key(script, args)
    if key in _BESIDE:
        return _BESIDE[key].result()
    return _example_run(key, script, args, timeout)


def _example_run(key: tuple, script: str, args: tuple[str, ...], timeout: float) -> tuple:
    """:func:`run_example`'s run of ``script ARGS``, made once for ``key``."""
    if key not in _EXAMPLE_RUNS:
        tmp = Path(tempfile.mkdtemp(prefix="example_"))
        cwd, root = tmp / "cwd", tmp / "runs"
        cwd.mkdir()
        command = [sys.executable, str(ROOT / script), *args, f"--trainer.default_root_dir={root}"]
        environment = started_environment()
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environment)
        _EXAMPLE_RUNS[key] = (result, cwd, root)
    return _EXAMPLE_RUNS[key]


def example_beside(script: str, *args: str, timeout: float = 400) -> None:
    """Register :func:`run_example`'s run of ``script ARGS`` to start beside the in-process tests (:func:`beside`);
    :func:`run_example` then gives its result. Call at import time of a test module."""
    key = _example_key(script, args)
    if key not in _BESIDE:
        _BESIDE[key] = _Beside(partial(_example_run, key, script, args, timeout), _caller_module())


class _Beside:
    """A run registered to start beside the in-process tests (see :func:`beside`): its function, the file of the test
    module that registered it, and its future once submitted."""

    def __init__(self, job: Callable[[], object], module: str) -> None:
        self.job, self.module = job, module
        self.future: Future | None = None
        self.lock = threading.Lock()

    def submit(self, pool: ThreadPoolExecutor) -> None:
        """Queue the run on ``pool``, once."""
        with self.lock:
            if self.future is None:
                self.future = pool.submit(self.job)

    def result(self):
        """The run's result (raising what it raised): waiting for it if it runs, run here and now if it has not
        begun."""
        with self.lock:
            if self.future is None or self.future.cancel():
                self.future = Future()
                try:
                    self.future.set_result(self.job())
                except BaseException as error:  # noqa: BLE001 - given to whoever reads the result, as a thread's
                    self.future.set_exception(error)
        return self.future.result()


_BESIDE: dict[object, _Beside] = {}
"""The runs registered to start beside the in-process tests, by key (:func:`beside`, :func:`example_beside`)."""

_POOL = ThreadPoolExecutor(2, thread_name_prefix="beside")
"""The threads the registered runs start in (two runs at a time, beside the shared launches' own thread)."""


def _caller_module() -> str:
    """The file of the test module that called the caller of this function."""
    return str(Path(sys._getframe(2).f_globals["__file__"]).resolve())


_SCRATCH: list[Path] = []
"""The directories :func:`scratch` made, removed at the session's end."""


def scratch(prefix: str) -> Path:
    """A new empty directory for a run registered at import time (where no ``tmp_path`` exists yet), removed at the
    session's end."""
    _SCRATCH.append(Path(tempfile.mkdtemp(prefix=prefix)))
    return _SCRATCH[-1]


def beside(key: str, job: Callable[[], object]) -> Callable[[], object]:
    """Register ``job`` (it starts processes and waits for them) to start in a thread while the in-process tests run,
    if a test of the calling module is selected; return a function that gives its result, or raises what it raised,
    waiting for it, or running it then if it has not begun. Call at import time of a test module.

    A launch of stage processes keeps about one core busy: its processes import Lightning and then mostly wait for
    each other. Started beside the tests that run in the pytest process, such runs use the other core, two at a
    time; a run checks within a time of its own end only what its own processes did.
    """
    _BESIDE[key] = _Beside(job, _caller_module())
    return _BESIDE[key].result


_SHARED: dict[int, list[tuple[str, tuple[str, ...], float, str, int | None, str]]] = {}
"""Registered runs of worker scripts, by number of stage processes: (script, args, timeout, name, output_of, the
file of the test module that registered it)."""

_LAUNCHING = threading.Lock()
"""Held while a shared launch runs, by the test that needs it or by :func:`_launch_beside_the_tests`."""

_LAUNCHED: dict[int, tuple[Path, subprocess.CompletedProcess]] = {}
"""The launches made so far, by number of stage processes: (their output directory, the result)."""


def shared_run(
    script: str,
    *args: str,
    devices: int,
    timeout: float = 300,
    name: str | None = None,
    output_of: int | None = None,
):
    """Register a run of ``tests/workers/<script>`` on ``devices`` stage processes; return a function giving its
    output directory (``OUT_DIR``: the script's first argument, or where an argument is ``"{out}"``), after the run.

    Call at import time of a test module. All runs registered for K processes share one launch
    (tests/workers/together.py), at the first call of any of their functions, so Lightning is imported once per
    process for all of them; launches for fewer processes come first. The output directory is ``name`` (by default
    the script's name and ``args``) in a directory of the launch, or with ``output_of=J``, of the launch on J
    processes (e.g. to resume from checkpoints a run there wrote). The function raises ``AssertionError`` with the
    script's traceback if it failed.
    """
    name = name or "-".join([Path(script).stem, *(arg.strip("-").replace("=", "") for arg in args)])
    module = _caller_module()
    _SHARED.setdefault(devices, []).append((script, args, timeout, name, output_of, module))

    def output() -> Path:
        _launch(devices)
        out = _LAUNCHED[devices if output_of is None else output_of][0] / name
        failed = sorted(out.glob("failed_rank*.txt"))
        assert not failed, f"{script} {' '.join(args)} failed:\n" + failed[0].read_text()[-3000:]
        return out

    return output


def shared_log(devices: int) -> str:
    """What the shared launch on ``devices`` processes wrote to stderr and stdout (after a :func:`shared_run`)."""
    result = _LAUNCHED[devices][1]
    return result.stderr + result.stdout


def _launch(devices: int) -> Path:
    """The output root of the shared launch on ``devices`` processes, launching it (and smaller ones) if needed, or
    waiting for it where :func:`_launch_beside_the_tests` is launching it."""
    with _LAUNCHING:
        for k in sorted(_SHARED):
            if k > devices or k in _LAUNCHED:
                continue
            root = Path(tempfile.mkdtemp(prefix=f"shared_K{k}_"))
            command = []
            for script, args, _, name, output_of, _ in _SHARED[k]:
                out = (root if output_of is None else _LAUNCHED[output_of][0]) / name
                out.mkdir(exist_ok=True)
                command += ["--", f"{out}:{script}", *args]
            timeout = sum(run[2] for run in _SHARED[k])
            result = run_worker("together.py", str(k), *command[1:], timeout=timeout, inherit=_ENVIRONMENT)
            _LAUNCHED[k] = (root, result)
    root, result = _LAUNCHED[devices]
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _launch_beside_the_tests(devices: list[int]) -> None:
    """Make the shared launches on ``devices`` processes, smallest first, in a thread (see
    :func:`pytest_collection_modifyitems`); a launch that fails is made again by the first test that needs it,
    which then reports why."""

    def launch_each() -> None:
        for k in devices:
            try:
                _launch(k)
            except (AssertionError, subprocess.TimeoutExpired):
                return

    threading.Thread(target=launch_each, name="shared launches", daemon=True).start()


def pytest_collection_modifyitems(session, config, items):
    """Run the tests that start no stage process (tests/unit) first, and meanwhile, in threads, the shared launches
    and the runs registered with :func:`beside` that the selected tests read: a launch keeps about one of the two
    cores busy (its processes mostly wait for each other), the in-process tests the other, so the suite takes
    about the time of the longer of the two rather than of both."""
    items.sort(key=lambda item: "distributed" in item.path.parts)
    selected = {str(item.path.resolve()) for item in items}
    needed = sorted(k for k, runs in _SHARED.items() if any(run[5] in selected for run in runs))
    if needed:
        _launch_beside_the_tests(needed)
    for run in _BESIDE.values():
        if run.module in selected:
            run.submit(_POOL)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """Destroy a process group an in-process test left (e.g. a strategy that failed in setup), and restore the
    environment Lightning's launcher changed, so that later tests and the workers they start begin clean."""
    environment = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def pytest_sessionfinish(session):
    """Stop the runs still running (a session ended by ``-x`` or an interrupt before a shared launch beside the tests
    did), then remove the shared launches' and the example runs' output directories."""
    _POOL.shutdown(wait=False, cancel_futures=True)
    for process in list(_RUNNING):
        process.terminate()
    for root, _ in _LAUNCHED.values():
        shutil.rmtree(root, ignore_errors=True)
    for _, cwd, _ in _EXAMPLE_RUNS.values():
        shutil.rmtree(cwd.parent, ignore_errors=True)
    for directory in _SCRATCH:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def reference_state():
    """State dict of TupleNet after single-device plain Lightning training (the ground truth)."""
    from models import fit

    return fit().state_dict()


def one_stage_pipeline(module, chunks: int, checkpoint: str, defer_weight_grad: bool = False):
    """Split ``module.backbone`` into a one-stage pipeline in this process.

    Calling ``module.backbone`` then runs the fill (straight through the runtime: there is no user step around
    the calls here); the returned fill-drain :class:`~lightning_gpipe.engine.pipeline.Runtime`'s ``backward()`` runs the
    drain, and its ``stages[0].events`` records the spans.
    """
    import torch

    from lightning_gpipe.engine.model_chunk import ModelChunk
    from lightning_gpipe.engine.partition import Split
    from lightning_gpipe.engine.pipeline import Runtime
    from lightning_gpipe.engine.transfer import Link
    from lightning_gpipe.faults.job import Job

    split = Split(module, "backbone", [len(module.backbone)], stage_index=0)
    link = Link(None, None, torch.device("cpu"), job=Job())
    stage = ModelChunk(split.partition, link, 0, 1, chunks, checkpoint, defer_weight_grad)
    runtime = Runtime([stage], "gpipe", 1)
    split.partition.backbone_call = _ThroughSchedule(runtime)
    return runtime


class _ThroughSchedule:
    """A :class:`~lightning_gpipe.engine.microbatch.PipelinedCall` that runs the schedule's forward on every call."""

    def __init__(self, schedule) -> None:
        self.schedule = schedule

    def __call__(self, value):
        return self.schedule.forward(value)

    def forward_and_share(self, value, fn):
        return fn(self.schedule.forward(value))


def assert_states_close(state: dict, expected: dict, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """Assert two state dicts have the same keys and every entry is close (fp32 default: 1e-5 absolute)."""
    import torch

    assert state.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], atol=atol, rtol=rtol, msg=key)


def state_distance(state: dict, other: dict) -> float:
    """The L2 norm of the difference of two states over all of ``state``'s tensors (the bf16 runs' measure: AdamW
    turns small gradient differences into steps of about its learning rate, so no single entry is a useful bound)."""
    import torch

    return torch.sqrt(sum(((state[k].float() - other[k].float()) ** 2).sum() for k in state)).item()


ROUNDING_FACTOR = 4
"""How far from the float64 result a pipelined fp32 fit may land, in multiples of the one-device fp32 fit's own
largest distance to it (over all its tensors), on top of the suite's 1e-5."""


def assert_within_fp32_rounding(state: dict, expected: dict, exact: Callable[[], dict]) -> None:
    """Assert every tensor of ``state`` (a pipelined fp32 fit) is within 1e-5 of ``expected`` (the one-device fp32
    fit), or, where AdamW amplifies the rounding of another CPU's kernels past that (an AMD EPYC's MKL and ATen
    paths differ from an Intel Xeon's, and AVX-512's from AVX2's), no farther from ``exact()`` (the float64 fit, made
    only then: the mixtures of experts' grouped products take no float64) than ``ROUNDING_FACTOR`` times the one-device
    fp32 fit's own largest distance to it, plus 1e-5: what fp32 rounding can explain, not an engine error. The bound
    is the fit's, not each tensor's: AdamW turns a gradient at rounding level into a step of about its learning rate,
    of either sign, so which tensor lands farthest from float64 depends on the CPU's kernels (a ResNeXt's batch-norm
    bias, 11x its own fp32 distance on an AVX-512 EPYC, within 1x the fit's)."""
    import torch

    assert state.keys() == expected.keys()
    far = [key for key in expected if not torch.allclose(state[key], expected[key], atol=1e-5, rtol=0)]
    if not far:
        return
    reference = exact()
    own = max((expected[key].double() - reference[key]).abs().max().item() for key in expected)
    bound = 1e-5 + ROUNDING_FACTOR * own
    for key in far:
        torch.testing.assert_close(state[key].double(), reference[key], atol=bound, rtol=0, msg=f"{key} ({bound:.2e})")


def worker_module(script: str):
    """``tests/workers/<script>`` as a module, for what it defines (the run is under ``__main__``)."""
    import importlib.util

    path = Path(__file__).parent / "workers" / script
    spec = importlib.util.spec_from_file_location(f"{path.stem}_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_worker():
    """tests/workers/transformers_hf.py as a module (its families, starting models, LoRA config, batches and
    optimization)."""
    return worker_module("transformers_hf.py")


def documents_one_by_one(model, documents):
    """``documents`` (lists of token ids) through ``model``'s own forward one at a time, no padding, no packing: the
    mean next-token cross-entropy over all their targets, backpropagated (the gradients accumulate in ``model``)."""
    import torch

    total = sum(len(d) - 1 for d in documents)
    loss = torch.zeros(())
    for document in documents:
        if len(document) > 1:
            ids = torch.tensor([document])
            loss = loss + model(input_ids=ids, labels=ids).loss * (len(document) - 1) / total
    loss.backward()
    return loss.detach()


def hf_one_device_optimizer(model, options: dict, total_steps: int):
    """AdamW with ``CausalLM.configure_optimizers``' parameter groups (decay on tensors of >= 2 dimensions) and
    learning-rate schedule (``options``: the worker's ``OPTIMIZATION``) over ``model``'s trainable parameters, for a
    one-device reference: ``(optimizer, scheduler)``."""
    import torch

    from lightning_gpipe.hf.module import lr_factor

    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": options["weight_decay"]},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=options["lr"], betas=options["betas"])
    factor = lambda step: lr_factor(  # noqa: E731
        step, options["warmup_steps"], total_steps, options["decay"], options["min_lr_ratio"]
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def hf_train_one_device(model, optimizer, schedule, batches, bf16: bool = False) -> list[float]:
    """Train the Hugging Face ``model`` on one device, a step per batch of ``batches`` (its keyword arguments, with
    ``labels``), with ``optimizer`` and its learning-rate ``schedule`` (:func:`hf_one_device_optimizer`); under
    ``bf16``, the forward only in CPU autocast, as Lightning's ``bf16-mixed``. Returns the per-step losses."""
    import torch

    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
