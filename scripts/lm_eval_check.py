"""Check minisgl's /v1/completions against lm-evaluation-harness's own `hf` backend.

Runs lm-eval (installed by scripts/setup_lm_eval.sh in .peers/lm-eval) twice on the same two
tiny local tasks, written here into a temporary folder:

- `minisgl_mc`: multiple choice (log-likelihood of each choice, metric acc) over 32 made-up
  items (facts, arithmetic, word completion) from a local JSONL file;
- `minisgl_gen`: generate_until (greedy, until "\\n", 16 tokens, metric exact_match) over 8
  prompts from a local JSONL file;

once with `--model local-completions` pointed at a minisgl server (started here on a free port
with the model in float32) and once with `--model hf` (transformers, float32, CPU) on the same
model folder. It then compares the logged samples item by item: which multiple-choice items each
got right (the argmax of the per-choice log-likelihoods), the log-likelihood values themselves,
and the greedy generations side by side.

Exit status: 0 when the multiple-choice items right are the same, 1 when they differ, 2 when a
run failed (the server or lm-eval). Log-likelihoods further apart than --tol and differing
generations are reported (and flagged) but do not change the status unless --strict is given.

    bash scripts/setup_lm_eval.sh
    .venv/bin/python scripts/lm_eval_check.py [--model PATH] [--keep DIR] [--strict]

See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from minisgl_server import Server, exit_on_termination, resolve_model, work_folder

ROOT = Path(__file__).resolve().parent.parent
LM_EVAL = ROOT / ".peers" / "lm-eval" / "bin" / "lm_eval"
MC_TASK = "minisgl_mc"
GEN_TASK = "minisgl_gen"

# (question, choices, gold index)
MC_ITEMS: list[tuple[str, list[str], int]] = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Japan?", ["Beijing", "Seoul", "Tokyo", "Bangkok"], 2),
    ("What is the capital of Italy?", ["Rome", "Vienna", "Athens", "Lisbon"], 0),
    ("What is the largest planet in the solar system?", ["Mars", "Jupiter", "Venus"], 1),
    ("Which planet is closest to the Sun?", ["Earth", "Neptune", "Mercury", "Saturn"], 2),
    ("What color is the sky on a clear day?", ["green", "blue", "red"], 1),
    ("What color are ripe bananas?", ["purple", "yellow", "blue", "black"], 1),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("How many days are in a week?", ["five", "seven", "ten"], 1),
    ("How many months are in a year?", ["twelve", "ten", "eight", "fourteen"], 0),
    ("What is 2 + 2?", ["3", "4", "5", "6"], 1),
    ("What is 3 + 5?", ["7", "9", "8"], 2),
    ("What is 10 - 4?", ["6", "5", "7", "4"], 0),
    ("What is 6 times 7?", ["36", "42", "48", "49"], 1),
    ("What is 9 + 10?", ["21", "19", "18"], 1),
    ("What is half of 20?", ["5", "15", "10", "12"], 2),
    ("Which animal says moo?", ["cat", "cow", "dog", "duck"], 1),
    ("Which animal is known as the king of the jungle?", ["lion", "mouse", "rabbit"], 0),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("What is frozen water called?", ["steam", "ice", "sand"], 1),
    ("At what temperature in Celsius does water boil?", ["50", "100", "0", "200"], 1),
    ("Which gas do plants take in from the air?", ["oxygen", "helium", "carbon dioxide"], 2),
    ("What is the opposite of hot?", ["cold", "warm", "loud", "fast"], 0),
    ("What is the opposite of up?", ["left", "down", "over"], 1),
    ("Complete the phrase: once upon a", ["time", "table", "tree", "river"], 0),
    ("Complete the phrase: the early bird catches the", ["worm", "bus", "ball"], 0),
    ("Complete the phrase: better late than", ["never", "sorry", "early", "always"], 0),
    ("Which word is a fruit?", ["carrot", "apple", "potato", "onion"], 1),
    ("Which word is a color?", ["table", "green", "happy"], 1),
    ("Who wrote Romeo and Juliet?", ["Charles Dickens", "William Shakespeare", "Mark Twain"], 1),
    ("What is the chemical symbol for gold?", ["Ag", "Au", "Fe", "Go"], 1),
    ("How many sides does a triangle have?", ["three", "four", "five", "six"], 0),
]

# (prompt, answer): greedy continuations up to the end of the line
GEN_ITEMS: list[tuple[str, str]] = [
    ("The capital of France is", "Paris."),
    ("Question: What is 2 + 2?\nAnswer:", "4"),
    ("The first three letters of the alphabet are", "A, B, and C."),
    ("Question: What color is the sky?\nAnswer:", "Blue"),
    ("One, two, three, four,", "five"),
    ("Monday, Tuesday, Wednesday,", "Thursday"),
    ("Water is made of hydrogen and", "oxygen."),
    ("The opposite of day is", "night."),
]

MC_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
"""


def write_tasks(folder: Path) -> None:
    """The two datasets (JSONL) and their task YAMLs, in `folder` (lm-eval's --include_path)."""
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    mc.write_text(
        "".join(json.dumps({"question": q, "choices": c, "gold": g}) + "\n" for q, c, g in MC_ITEMS)
    )
    gen.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in GEN_ITEMS))
    (folder / f"{MC_TASK}.yaml").write_text(MC_YAML.format(task=MC_TASK, data=mc))
    (folder / f"{GEN_TASK}.yaml").write_text(GEN_YAML.format(task=GEN_TASK, data=gen))


# ------------------------------------------------------------------------------- lm-eval
def lm_eval_env() -> dict[str, str]:
    env = dict(os.environ)
    # Everything is local: never wait on the hub for the model, tokenizer or the json builder.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_lm_eval(name: str, model_args: list[str], tasks_dir: Path, out: Path, log: Path) -> float:
    """One lm-eval run with its output (results and samples) under `out`; returns its seconds."""
    cmd = [str(LM_EVAL), *model_args, "--tasks", f"{MC_TASK},{GEN_TASK}"]
    cmd += ["--include_path", str(tasks_dir), "--log_samples", "--output_path", str(out)]
    cmd += ["--seed", "1234"]
    print(f"\n[{name}] $ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with log.open("wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=lm_eval_env()).returncode
    took = time.monotonic() - t0
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise RuntimeError(f"lm-eval ({name}) exited with {rc} after {took:.0f}s:\n{tail}")
    print(f"[{name}] done in {took:.0f}s (log: {log})", flush=True)
    return took


def load_samples(out: Path, task: str) -> dict[int, dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise RuntimeError(f"no samples_{task}_*.jsonl under {out}")
    samples = {}
    for line in files[-1].read_text().splitlines():
        if line.strip():
            s = json.loads(line)
            samples[int(s["doc_id"])] = s
    return samples


def loglikelihoods(sample: dict) -> list[float]:
    """The per-choice log-likelihoods of one logged multiple-choice sample."""
    out = []
    for resp in sample["filtered_resps"]:
        # (loglikelihood, is_greedy), logged as a list (sometimes of strings).
        ll = resp[0] if isinstance(resp, (list, tuple)) else resp
        out.append(float(ll))
    return out


def greedy_flags(sample: dict) -> list[bool]:
    """Per choice, whether the continuation is the model's greedy one (lm-eval's is_greedy)."""
    return [
        str(r[1]) == "True" if isinstance(r, (list, tuple)) else False
        for r in sample["filtered_resps"]
    ]


def generation(sample: dict, filtered: bool) -> str:
    resp = sample["filtered_resps" if filtered else "resps"]
    while isinstance(resp, list):
        resp = resp[0] if resp else ""
    return str(resp)


# ------------------------------------------------------------------------------- compare
def compare(local_out: Path, hf_out: Path, tol: float) -> tuple[bool, bool]:
    """Print the comparison; returns (multiple-choice items right equal, all else within tol)."""
    ok_mc, ok_rest = True, True

    a, b = load_samples(local_out, MC_TASK), load_samples(hf_out, MC_TASK)
    if a.keys() != b.keys():
        print(f"! the two runs logged different {MC_TASK} items: {sorted(a)} vs {sorted(b)}")
        return False, False
    right_a, right_b, differ, max_diff, lines = 0, 0, [], 0.0, []
    argmax_differ, greedy_differ = [], []
    for doc_id in sorted(a):
        gold = int(a[doc_id]["doc"]["gold"])
        la, lb = loglikelihoods(a[doc_id]), loglikelihoods(b[doc_id])
        pa, pb = max(range(len(la)), key=la.__getitem__), max(range(len(lb)), key=lb.__getitem__)
        ra, rb = pa == gold, pb == gold
        # lm-eval's own acc field agrees with the argmax (a check on how samples are read).
        for s, r in ((a[doc_id], ra), (b[doc_id], rb)):
            if "acc" in s and bool(float(s["acc"])) != r:
                print(f"! item {doc_id}: logged acc {s['acc']} but argmax says {r}")
                ok_mc = False
        right_a += ra
        right_b += rb
        if ra != rb:
            differ.append(doc_id)
        if pa != pb:
            argmax_differ.append(doc_id)
        if greedy_flags(a[doc_id]) != greedy_flags(b[doc_id]):
            greedy_differ.append(doc_id)
        d = max(abs(x - y) for x, y in zip(la, lb))
        max_diff = max(max_diff, d)
        if d > tol:
            lines.append(f"  item {doc_id}: local {la} hf {lb} (max diff {d:.2e})")
    n = len(a)
    print("\nmultiple choice (log-likelihood)")
    header = f"{'task':<14}{'items':>6}{'acc local-completions':>23}{'acc hf':>9}"
    header += f"{'items that differ':>19}{'max |ll diff|':>15}"
    print(header)
    print(
        f"{MC_TASK:<14}{n:>6}{right_a / n:>23.4f}{right_b / n:>9.4f}"
        f"{len(differ):>19}{max_diff:>15.2e}"
    )
    if differ:
        ok_mc = False
        print(f"! items right in one run only: {differ}")
    if argmax_differ:
        print(f"! items whose chosen answer differs (right or not): {argmax_differ}")
        ok_rest = False
    if greedy_differ:
        print(f"! items whose is_greedy flags differ: {greedy_differ}")
        ok_rest = False
    if lines:
        ok_rest = False
        print(f"! log-likelihoods further apart than {tol:g}:")
        print("\n".join(lines))

    a, b = load_samples(local_out, GEN_TASK), load_samples(hf_out, GEN_TASK)
    print(f"\ngenerate_until ({GEN_TASK}, greedy, until \\n, 16 tokens): raw outputs")
    same = 0
    em_a = em_b = 0.0
    for doc_id in sorted(a):
        ga, gb = generation(a[doc_id], False), generation(b.get(doc_id, {"resps": ""}), False)
        em_a += float(a[doc_id].get("exact_match", 0))
        em_b += float(b.get(doc_id, {}).get("exact_match", 0))
        mark = "=" if ga == gb else "!"
        same += ga == gb
        print(f"  {mark} {doc_id}: local-completions {ga!r:<34} hf {gb!r}")
    n = len(a)
    print(
        f"{GEN_TASK}: {same}/{n} identical; exact_match local-completions "
        f"{em_a / n:.4f}, hf {em_b / n:.4f}"
    )
    if same != n or a.keys() != b.keys():
        ok_rest = False
        print("! the greedy generations differ")
    return ok_mc, ok_rest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: minisgl's default model)")
    p.add_argument("--tol", type=float, default=1e-3, help="log-likelihood tolerance")
    p.add_argument("--keep", default=None, help="work in this folder and keep it")
    p.add_argument("--strict", action="store_true", help="fail on --tol or generation diffs too")
    p.add_argument("--health-timeout", type=float, default=600.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra minisgl argument")
    args = p.parse_args()

    if not LM_EVAL.exists():
        print(f"{LM_EVAL} is missing: run bash scripts/setup_lm_eval.sh first", file=sys.stderr)
        return 2
    model = resolve_model(args.model)
    work = work_folder(args.keep, "minisgl-lm-eval-")
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    write_tasks(tasks)
    local_out, hf_out = work / "out-local-completions", work / "out-hf"
    for d in (local_out, hf_out):
        shutil.rmtree(d, ignore_errors=True)
    print(f"model: {model}\nwork folder: {work}", flush=True)

    exit_on_termination()

    t_start = time.monotonic()
    server = None
    try:
        server = Server(model, work / "server.log", ["--dtype", "float32", *args.server_arg])
        t0 = time.monotonic()
        server.wait_healthy(args.health_timeout)
        print(f"server healthy at {server.url} after {time.monotonic() - t0:.0f}s", flush=True)
        model_args = (
            f"model={model},base_url={server.url}/v1/completions,tokenizer={model},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
            "max_retries=1"
        )
        run_lm_eval(
            "local-completions",
            ["--model", "local-completions", "--model_args", model_args],
            tasks,
            local_out,
            work / "lm_eval-local-completions.log",
        )
    except (RuntimeError, OSError) as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        if server is not None:
            print(f"--- server log tail ({server.log}):\n{server.log_tail()}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
            print("server stopped", flush=True)

    try:
        run_lm_eval(
            "hf",
            ["--model", "hf", "--model_args", f"pretrained={model},dtype=float32"]
            + ["--device", "cpu", "--batch_size", "1"],
            tasks,
            hf_out,
            work / "lm_eval-hf.log",
        )
        ok_mc, ok_rest = compare(local_out, hf_out, args.tol)
    except (RuntimeError, OSError) as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        return 2
    print(f"\ntotal {time.monotonic() - t_start:.0f}s; outputs in {work}")
    if not ok_mc:
        print("RESULT: the multiple-choice items right differ")
        return 1
    if not ok_rest:
        print("RESULT: same items right; some values or generations differ (see above)")
        return 1 if args.strict else 0
    print("RESULT: same items right, log-likelihoods within tolerance, same generations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
