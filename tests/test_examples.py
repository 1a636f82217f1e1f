"""Each example runs a few steps with tiny sizes and prints its summary lines; train_gpt,
train_cnn, per_example_clipping and ensemble must also learn (loss down, accuracy well above
chance)."""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

import pytest
from _dist import ROOT, Job, script_env, torchrun

pytest.importorskip("tqdm")
pytest.importorskip("sklearn")

EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240.0
OUTPUT_TAIL_CHARS = 4000
GPT_CHECKPOINT = "gpt.pt"
# Each example with its arguments and ranks. train_gpt runs under torchrun as the README says;
# the other multi-rank examples run as ranks forked from the fork server with the environment
# torchrun sets (tests/_dist.py's Job.ranks), which spares each rank an import of torch.
TORCHRUN = {"train_gpt"}
RUNS = {
    "train_gpt": (
        "train_gpt.py",
        [
            *("--steps", "3", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "32"),
            *("--batch", "4", "--eval-every", "2", "--sample-chars", "20"),
        ],
        2,
    ),
    "train_gpt_diloco": (
        "train_gpt_diloco.py",
        [
            *("--steps", "8", "--every", "4", "--fragments", "2", "--delay", "1", "--bf16"),
            *("--layers", "1", "--dim", "32", "--heads", "2", "--seq", "32", "--batch", "4"),
        ],
        2,
    ),
    "train_cnn": (
        "train_cnn.py",
        ["--steps", "40", "--width", "8", "--batch", "8", "--eval-every", "20"],
        2,
    ),
    "train_fully_sharded": (
        "train_fully_sharded.py",
        [
            *("--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2"),
            *("--steps", "2", "--vocab", "64"),
        ],
        2,
    ),
    "train_remat": ("train_remat.py", ["--small"], 2),
    "torch_compile": ("torch_compile.py", ["--steps", "3", "--hidden", "16"], 1),
    "per_example_clipping": ("per_example_clipping.py", ["--steps", "30", "--batch", "8"], 2),
    "ensemble": ("ensemble.py", ["--steps", "30", "--members", "3", "--hidden", "16"], 1),
}


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Job], Path]:
    """Every example started at once (on 2 cores a one-process example leaves one idle); all
    but the torchrun one fork from the fork server, which has imported torch and fddp."""
    tmp = tmp_path_factory.mktemp("examples")
    jobs = {}
    for name, (script, args, ranks) in RUNS.items():
        if name == "train_gpt":
            args = [*args, "--out", str(tmp / GPT_CHECKPOINT)]
        argv = [str(EXAMPLES / script), *args]
        if name in TORCHRUN:
            command = [*torchrun("--standalone", f"--nproc_per_node={ranks}"), *argv]
            jobs[name] = Job(name, [(command, script_env())], tmp, TIMEOUT_S)
        elif ranks > 1:
            jobs[name] = Job.ranks(
                name, tmp, argv, world_size=ranks, timeout=TIMEOUT_S, forked=True
            )
        else:
            command = [sys.executable, *argv]
            jobs[name] = Job(name, [(command, script_env())], tmp, TIMEOUT_S, forked=True)
    try:
        yield jobs, tmp
    finally:
        for job in jobs.values():
            job.stop()


def run_example(examples, name: str) -> str:
    """The combined output of example ``name`` (every process's, in rank order), once each of
    its processes has exited with status 0."""
    jobs, _ = examples
    job = jobs[name].wait()
    output = "".join(job.output(i) for i in range(len(job.procs)))
    assert job.returncodes() == [0] * len(job.procs), (
        f"{RUNS[name][0]} exited with {job.returncodes()}:\n{output[-OUTPUT_TAIL_CHARS:]}"
    )
    return output


def number(pattern: str, output: str) -> float:
    match = re.search(pattern, output)
    assert match, f"no line matching {pattern!r} in:\n{output[-OUTPUT_TAIL_CHARS:]}"
    return float(match.group(1))


def test_train_gpt_two_ranks(examples) -> None:
    checkpoint = examples[1] / GPT_CHECKPOINT
    output = run_example(examples, "train_gpt")
    assert "2 rank(s) x batch 4 x 32" in output
    assert "compiled schedule (rank 0):" in output
    # every output (params, AdamW state, the pmean'd loss) replicated, summed up in one line
    summary = [line for line in output.splitlines() if "replicated" in line]
    assert len(summary) == 1 and re.fullmatch(r"outputs: \d+ replicated; .*", summary[0]), summary
    before = number(r"step 0: train loss ([\d.]+)", output)
    after = number(r"step 3: train loss ([\d.]+)", output)
    assert after < before
    assert f"saved checkpoint {checkpoint}" in output and checkpoint.exists()
    assert "sample (temperature 0.8, from the reloaded checkpoint):" in output


def test_train_gpt_diloco_two_ranks(examples) -> None:
    output = run_example(examples, "train_gpt_diloco")
    assert "2 rank(s) x batch 4 x 32; DiLoCo every 4 steps" in output
    before = number(r"step 0: eval loss ([\d.]+)", output)
    after = number(r"final eval loss ([\d.]+)", output)
    assert after < before  # 5.25 -> 4.57 with these settings


def test_train_cnn_two_ranks(examples) -> None:
    output = run_example(examples, "train_cnn")
    assert "2 rank(s) x batch 8" in output
    assert re.search(r"step 20: train loss [\d.]+, test loss [\d.]+, test accuracy", output)
    first = number(r"test loss: ([\d.]+) -> [\d.]+;", output)
    last = number(r"test loss: [\d.]+ -> ([\d.]+);", output)
    assert last < 0.5 * first  # 2.32 -> 0.76 with these settings
    assert number(r"final test accuracy ([\d.]+)%", output) >= 50  # 10 classes; it reaches 77.5


def test_train_fully_sharded_two_ranks(examples) -> None:
    output = run_example(examples, "train_fully_sharded")
    assert "2 rank(s) x batch 2 x 16" in output
    for rank in range(2):
        count = number(rf"rank {rank}: (\d+) parameters; at rest", output.replace(",", ""))
        assert count == 17376  # 1 layer of width 32 over 64 tokens, 16 positions
        assert re.search(rf"rank {rank}: step 2: loss [\d.]+, [\d.]+ s, peak RSS", output)
        assert f"rank {rank}: done: 17,376 parameters trained fully sharded on 2" in output
    # 2 ranks: at rest 6 of replicated AdamW's 16 bytes per parameter (plus bucket padding)
    at_rest = number(r"rank 0: [\d,]+ parameters; at rest ([\d.]+) MB", output)
    replicated = number(r"replicated AdamW: ([\d.]+) MB", output)
    assert at_rest < 0.5 * replicated
    assert re.search(r"schedule \(rank 0\): [1-9]\d* parameter gathers", output)
    first = number(r"rank 0: step 1: loss ([\d.]+)", output)
    assert math.isclose(first, math.log(64), rel_tol=0.1)  # random tokens: 4.18 vs ln 64 = 4.16


def test_train_remat_two_ranks(examples) -> None:
    """--small: 2 blocks over 256 tokens (the default, 16 blocks over 8,192 tokens, would
    keep 34.5 GiB for the two ranks without remat and takes minutes a step)."""
    output = run_example(examples, "train_remat")
    for rank in range(2):
        without = number(rf"rank {rank}: saved for backward \(the plan\): ([\d.]+) MiB", output)
        kept = number(
            rf"rank {rank}: saved for backward .* MiB without remat, ([\d.]+) MiB", output
        )
        assert kept < without / 4  # each block keeps its input, not its attention matrices
        assert f"rank {rank}: done: 2 steps fully sharded with remat" in output
    first = number(r"rank 0: step 1: loss ([\d.]+)", output)
    assert math.isclose(first, math.log(256), rel_tol=0.1)  # random tokens over 256
    assert number(r"rank 1: step 2: loss ([\d.]+)", output) == number(
        r"rank 0: step 2: loss ([\d.]+)", output
    )  # the pmean'd loss, the same on both ranks


def test_torch_compile_one_rank(examples) -> None:
    output = run_example(examples, "torch_compile")
    assert number(r"fx vs inductor, over 3 steps: ([\d.e+-]+)", output) < 1e-4
    assert number(r"largest parameter difference ([\d.e+-]+)", output) < 1e-5


def test_per_example_clipping_two_ranks(examples) -> None:
    output = run_example(examples, "per_example_clipping")
    first = number(r"step    0  loss ([\d.]+)", output)
    last = number(r"final loss ([\d.]+)", output)
    assert 0 < last < first  # 2.29 -> 2.05 with these settings
    assert number(r"train accuracy ([\d.]+)", output) >= 0.4  # 10 classes; it reaches 0.61


def test_ensemble_one_process(examples) -> None:
    output = run_example(examples, "ensemble")
    first = re.search(r"step    0  member losses \[([\d., ]+)\]", output)
    last = re.search(r"step   29  member losses \[([\d., ]+)\]", output)
    assert first and last, output[-OUTPUT_TAIL_CHARS:]
    for before, after in zip(first.group(1).split(","), last.group(1).split(","), strict=True):
        assert float(after) < 0.7 * float(before)  # every member learns: 2.35 -> 1.04-1.24
    for m in range(3):  # 10 classes; after 30 steps the members reach 74-79 %, untrained 10-20 %
        assert number(rf"member {m}: test accuracy ([\d.]+)%", output) >= 50
    assert number(r"ensemble of 3 \(mean logits\): test accuracy ([\d.]+)%", output) >= 60  # 79.3


def test_train_recover_through_the_launcher(tmp_path: Path) -> None:
    """The documented command, shortened: rank 2 dies, the job ends with exit 0 and every
    worker's parameters are those of one process without failures (invariant mode)."""
    script = EXAMPLES / "train_recover.py"
    command = shlex.split(script.read_text().splitlines()[0].strip('"'))
    assert (
        command[:3] == ["python", "-m", "fddp.run"] and command[-1] == "examples/train_recover.py"
    )
    short = ["--steps", "12", "--kill-at", "4"]
    launched = Job(
        "train_recover", [([sys.executable, *command[1:], *short], script_env())], tmp_path
    )
    alone = [sys.executable, str(script), *short[:2]]
    reference = Job("train_recover_alone", [(alone, script_env())], tmp_path, forked=True)
    try:
        reference.assert_succeeded()
        launched.assert_succeeded()
    finally:
        launched.stop()
        reference.stop()
    output = launched.output(0)
    assert "fddp.run: rank 2 (pid" in output and "was killed by SIGKILL" in output, output
    (want,) = re.findall(r"final params sha256 (\w+)", reference.output(0))
    got = re.findall(r"rank (\d+): final params sha256 (\w+)", output)
    assert {"0", "1"} <= {rank for rank, _ in got}, output
    assert {digest for _, digest in got} == {want}, output
