"""Does every worker start compiled? Four starts of `python -m handler serve`, each a fresh process
on the same GPU:

  (a) an empty Triton cache and no artifact (ENGINE_MODE=auto runs jit; as the fleet's first worker
      it publishes its kernels beside the snapshot once it has served);
  (b) an artifact built on this machine with no GPU visible
      (`CUDA_VISIBLE_DEVICES= python -m warmup build --no-gpu --arch <this GPU's>`), an empty Triton
      cache;
  (c) the artifact (a) published, an empty Triton cache;
  (d) ENGINE_MODE=jit with a warm Triton cache (a worker before it compiled the whole kernel set
  there), twice: how far two runs of one mode agree is the control for the others' agreement.

Each: one streamed request is sent as soon as the server listens (start -> first token, client-timed
from the spawn), then 32 concurrent streams (mixed prompt lengths, 64 tokens, greedy): burst wall
time, time to first token p50 / p99, the median stream's longest pause between two tokens; then one
request per burst prompt length sent alone (32 tokens). The greedy tokens of every request are
compared across the four (the model's tokenizer is word-level: one word per token id, so texts
compare token ids): the burst's depend on how its streams were batched, so a second (d) is their
control; those sent alone do not. For (b) and (c), the kernels the run compiled that its artifact
did not bring are listed. With --rounds N, (c), (b) and (d) start N times, in an order that turns by
one each round, and the targets compare each mode's medians.

`python -m bench.compiled_start --out $OUT` on a GPU machine: synthesizes the model
(bench.checkpoint), writes $OUT/compiled-start.json and prints the table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PORT_LINE = re.compile(r"OpenAI server on http://127\.0\.0\.1:(\d+)/v1")
BURST = 32
BURST_TOKENS = 64
BURST_PROMPT_LENS = (16, 64, 128, 300, 700, 1500)
ALONE_TOKENS = 32  # per request sent alone after the burst, one per burst prompt length


def word_level_tokenizer(model_dir: str, vocab_size: int) -> None:
    """tokenizer.json with one word per id ("t0" ... ), so outputs are text that spells their token
    ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(os.path.join(model_dir, "tokenizer.json"))


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(salt * 7919 + 131 * i) % (vocab - 3) + 3 for i in range(n)]


class Serve:
    """`python -m handler serve --port 0` with its output kept (and timestamped) for the log lines
    it waits on."""

    def __init__(self, env: dict[str, str]):
        full = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MODEL_", "ENGINE_", "TRITON_CACHE"))
        }
        full.update(
            env,
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        )
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "handler", "serve", "--host", "127.0.0.1", "--port", "0"],
            cwd=REPO,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.port: int | None = None
        self._port_seen = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._port_seen.wait(300) or self.port is None:
            raise RuntimeError("serve did not listen:\n" + self.output())

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.spawned, line.rstrip()))
            m = PORT_LINE.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port_seen.set()
        self._port_seen.set()

    def output(self, last: int = 80) -> str:
        return "\n".join(line for _, line in self.lines[-last:])

    def wait_for(self, pattern: str, timeout: float) -> bool:
        """Until a log line matches (the kernel warm-up and the fleet's publish come once the
        engine has served and is idle), the process exits, or the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for _, line in self.lines):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def kernel_names(triton_cache: Path) -> list[str]:
    """The kernels in a Triton cache directory (each entry's metadata file is named after its
    kernel), sorted, one per compiled entry."""
    return sorted(
        p.stem
        for p in triton_cache.glob("*/*.json")
        if not p.name.startswith("__grp__") and p.parent.name != ".coldbrew-installed"
    )


def compiled_at_run_time(run_cache: Path, artifact_cache: Path | None) -> list[str]:
    """Kernels the run's Triton cache holds that the artifact it started from did not bring."""
    have = kernel_names(artifact_cache) if artifact_cache else []
    extra = list(kernel_names(run_cache))
    for name in have:
        if name in extra:
            extra.remove(name)
    return extra


def stream(port: int, ids: list[int], max_tokens: int) -> dict:
    """One streamed /v1/completions request, greedy, exactly max_tokens: its chunks' arrival times
    and text."""
    body = json.dumps(
        {
            "model": "bench",
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    times, text = [], []
    if resp.status != 200:
        return {
            "sent": sent,
            "error": f"{resp.status} {resp.read()[:300]!r}",
            "times": [],
            "text": "",
        }
    while line := resp.readline():
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
        if piece:
            times.append(time.perf_counter())
            text.append(piece)
    conn.close()
    return {"sent": sent, "times": times, "text": "".join(text)}


PROFILE: dict[str, str] = {}  # run name -> where py-spy writes its speedscope file (--py-spy)


def busy_processes(min_cpu: float = 5.0) -> dict:
    """What else runs as a start begins: the 1-minute load average, and the processes using at
    least min_cpu % of a core over their life (`ps`), with their age and command line."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,pcpu=,etimes=,args="], capture_output=True, text=True, check=False
    ).stdout
    busy = []
    for line in out.splitlines():
        pid, cpu, age, args = (line.split(None, 3) + [""])[:4]
        if int(pid) != os.getpid() and float(cpu) >= min_cpu:
            busy.append(
                {"pid": int(pid), "cpu_pct": float(cpu), "age_s": int(age), "cmd": args[:160]}
            )
    return {"load_1m": os.getloadavg()[0], "processes": busy}


def measure(
    name: str,
    env: dict[str, str],
    vocab: int,
    wait_line: str | None = None,
    wait_s: float = 300.0,
    burst_delay_s: float = 0.0,
) -> dict:
    """One start: the first streamed request, then (burst_delay_s later) the burst; optionally wait
    for a log line before stopping. With --py-spy naming this run, py-spy samples every thread of
    the server from when it listens to its exit (bench.start_profile summarises the samples;
    bench.burst_profile places them by the exit, stopped_s)."""
    before = busy_processes()
    server = Serve(env)
    spy = None
    if name in PROFILE:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        cmd = [exe, "record", "--pid", str(server.proc.pid), "--threads", "--idle"]
        cmd += ["--nonblocking", "-r", "200", "--format", "speedscope", "-o", PROFILE[name]]
        spy = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    first = stream(server.port, prompt(128, 0, vocab), 16)
    if not first["times"]:
        server.stop()
        raise RuntimeError(
            f"[{name}] first request failed: {first.get('error')}\n" + server.output()
        )
    time.sleep(burst_delay_s)
    burst: list[dict] = [{} for _ in range(BURST)]
    gate = threading.Barrier(BURST)

    def one(i: int) -> None:
        gate.wait()
        burst[i] = stream(
            server.port,
            prompt(BURST_PROMPT_LENS[i % len(BURST_PROMPT_LENS)], 100 + i, vocab),
            BURST_TOKENS,
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the same prompts one at a time: alone in the engine, a request's greedy tokens do not depend
    # on what it was batched with, so they compare across starts
    alone = [  # prompts of their own: no prefix of theirs was cached by the burst
        stream(server.port, prompt(n, 200 + i, vocab), ALONE_TOKENS)["text"]
        for i, n in enumerate(BURST_PROMPT_LENS)
    ]
    waited = server.wait_for(wait_line, wait_s) if wait_line else None
    code = server.stop()
    stopped = time.perf_counter() - server.spawned
    profile = None
    if spy is not None:
        from bench.start_profile import summarise

        spy.wait(timeout=60)
        profile = summarise(PROFILE[name]) if os.path.exists(PROFILE[name]) else None
    start = min(r["sent"] for r in burst)
    ttft = sorted(r["times"][0] - r["sent"] for r in burst if r["times"])
    pauses = sorted(
        max((b - a for a, b in zip(r["times"], r["times"][1:])), default=0.0) for r in burst
    )
    keep = re.compile(r"ready:|kernels:|engine mode:|fleet:|CUDA graphs|warmup|stream")
    return {
        "name": name,
        "first_token_s": first["times"][0] - server.spawned,
        "first_text": first["text"],
        "burst_wall_s": max(r["times"][-1] for r in burst if r["times"]) - start,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "median_longest_pause_s": statistics.median(pauses),
        "longest_pause_s": pauses[-1],
        "burst_texts": [r["text"] for r in burst],
        "alone_texts": alone,
        "errors": [r["error"] for r in burst if "error" in r],
        "waited_for": wait_line,
        "wait_found": waited,
        "exit_code": code,
        "stopped_s": stopped,
        "log": [f"{t:7.2f}s {line}" for t, line in server.lines if keep.search(line)],
        "busy_before_start": before,
        "profile": profile,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="llama-3.1-8b.json")
    ap.add_argument(
        "--root", default="/tmp/coldbrew-compiled-start", help="models, caches and artifacts"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="starts of (c), (b) and (d) in turn, each (b) and (c) from an empty Triton cache; "
        "the targets compare medians (the second (d) is the burst tokens' control)",
    )
    ap.add_argument(
        "--py-spy",
        default="",
        help="comma list of runs to sample with py-spy (a, b, c, d; later rounds: b#2, d2, ...)",
    )
    ap.add_argument(
        "--burst-delay",
        type=float,
        default=0.0,
        help="seconds between the first request's end and the burst (the worker's background "
        "kernel warm-up begins once it sees the engine idle, polled every 0.5 s: a delay over "
        "that makes the burst meet it)",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for run in filter(None, args.py_spy.split(",")):
        # no "#" in the file name (b#2 -> b-2): the device tool returns plain names only
        PROFILE[run] = os.path.join(args.out, f"{run.replace('#', '-')}.speedscope.json")
    import torch

    from bench.checkpoint import synthesize
    from engine.config import ModelConfig

    t0 = time.perf_counter()
    root = Path(args.root)
    # caches and artifacts of a previous run; the model (and its pack) stay
    for old in root.glob("*"):
        if old.name != "model":
            shutil.rmtree(old, ignore_errors=True)
    model_dir = synthesize(args.config, str(root / "model"), device="cuda")
    shutil.rmtree(os.path.join(model_dir, "engines"), ignore_errors=True)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    word_level_tokenizer(model_dir, vocab)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": args.config,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "arch": arch,
        "max_model_len": args.max_model_len,
        "burst": BURST,
        "burst_tokens": BURST_TOKENS,
        "rounds": args.rounds,
        "burst_delay_s": args.burst_delay,
        "runs": {},
    }
    torch.cuda.empty_cache()
    path = os.path.join(args.out, "compiled-start.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    def log(msg: str) -> None:
        """Print, and write what was measured so far (a run cut short keeps it)."""
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)
        save()

    def env(tag: str, mode: str, triton: str | None = None) -> dict[str, str]:
        return {
            "MODEL_NAME": model_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "bench",
            "ENGINE_MODE": mode,
            "MAX_MODEL_LEN": str(args.max_model_len),
            "CACHE_DIR": str(root / f"cache-{tag}"),
            "TRITON_CACHE_DIR": str(root / f"triton-{triton or tag}"),
        }

    runs = report["runs"]
    # The first start writes the pack; it also fills the warm cache of (d) with the whole kernel
    # set.
    runs["prime"] = measure("prime", env("prime", "jit", "warm"), vocab, r"kernels: the set's")
    log(f"prime (writes the pack, warms (d)'s cache): {runs['prime']['first_token_s']:.2f} s")
    runs["a"] = measure("a", env("a", "auto"), vocab, r"fleet: (shared|could not)")
    log(
        f"(a) empty cache: {runs['a']['first_token_s']:.2f} s; published: {runs['a']['wait_found']}"
    )
    published = Path(model_dir) / "engines"
    hidden = root / "engines-published"

    def show_published(visible: bool) -> None:
        """(a) may have published beside the snapshot: (c) must see it there, (b) only its own."""
        src, dst = (hidden, published) if visible else (published, hidden)
        if src.exists():
            src.rename(dst)

    def artifact_of(cache_dir: Path) -> Path | None:
        # where an artifact is installed from: beside the snapshot, or its cache dir's engines/
        dirs = (published, cache_dir / "engines")
        return next((p for d in dirs for p in d.glob("*/triton-cache")), None)

    built = None

    def artifact_start(name: str, environ: dict[str, str], cache: str, what: str) -> None:
        """A start that installs an artifact: measured, with the artifact's kernel count and the
        kernels the run still compiled (its Triton cache against the artifact's)."""
        run = runs[name] = measure(name, environ, vocab, burst_delay_s=args.burst_delay)
        artifact = artifact_of(root / cache)
        run["artifact_kernels"] = len(kernel_names(artifact)) if artifact else 0
        run["compiled_at_run_time"] = compiled_at_run_time(
            Path(environ["TRITON_CACHE_DIR"]), artifact
        )
        log(
            f"({name}) {what}: {run['first_token_s']:.2f} s; its kernels "
            f"{run['artifact_kernels']}, compiled at run time {run['compiled_at_run_time']}"
        )

    def run_c(r: int, tag: str) -> None:
        show_published(True)
        environ = {**env("c", "auto", f"c{r}"), "CACHE_DIR": str(root / "cache-a")}
        artifact_start("c" + tag, environ, "cache-a", "published artifact")

    def run_b(r: int, tag: str) -> None:
        nonlocal built
        show_published(False)
        if built is None:
            built = gpuless_build(report, model_dir, arch, args.max_model_len, root, log)
        if built.returncode == 0:
            artifact_start("b" + tag, env("b", "auto", f"b{r}"), "cache-b", "GPU-less artifact")

    def run_d(r: int, tag: str) -> None:
        # (d) of the second round is the control: how far a burst's greedy tokens agree between
        # two runs of one mode
        name = "d" if r == 0 else "d2" if r == 1 else "d" + tag
        runs[name] = measure(name, env("d", "jit", "warm"), vocab, burst_delay_s=args.burst_delay)
        log(f"({name}) warm cache: {runs[name]['first_token_s']:.2f} s")

    order = [run_c, run_b, run_d]
    for r in range(args.rounds):
        # each round's (b) and (c) start from an empty Triton cache of their own, like a new
        # worker; the order turns by one each round, so no mode always follows the same one
        for run in order[r % 3 :] + order[: r % 3]:
            run(r, "" if r == 0 else f"#{r + 1}")
    summarize(report)
    save()
    print_table(report)


def gpuless_build(
    report: dict, model_dir: str, arch: str, max_model_len: int, root: Path, log
) -> subprocess.CompletedProcess:
    """`python -m warmup build --no-gpu` for this GPU's arch with no GPU visible, into (b)'s cache
    dir; its output in report["gpuless_build"]."""
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    t0 = time.perf_counter()
    built = subprocess.run(
        [sys.executable, "-m", "warmup", "build", "--model", model_dir, "--no-gpu"]
        + ["--arch", arch, "--max-model-len", str(max_model_len)]
        + ["--out-dir", str(root / "cache-b" / "engines")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report["gpuless_build"] = {
        "seconds": time.perf_counter() - t0,
        "rc": built.returncode,
        "stdout": built.stdout[-2000:],
        "stderr": built.stderr[-3000:],
    }
    seconds = report["gpuless_build"]["seconds"]
    log(f"GPU-less build for {arch}: rc {built.returncode} in {seconds:.1f} s")
    return built


MODES = {
    "a": "(a) empty cache, jit",
    "b": "(b) GPU-less artifact",
    "c": "(c) published artifact",
    "d": "(d) warm cache",
}
MEASURES = ("first_token_s", "ttft_p99_s", "median_longest_pause_s")


def runs_of(runs: dict, mode: str) -> list[dict]:
    """A mode's starts over the rounds: "b", "b#2", ...; (d)'s second is "d2"."""
    return [r for k, r in runs.items() if k.split("#")[0] in (mode, mode + "2") and k != "prime"]


def summarize(report: dict) -> None:
    runs = report["runs"]
    d = runs.get("d")
    starts = {k: r for k, r in runs.items() if k != "prime"}
    report["tokens"] = {
        "first_request_identical": len({r["first_text"] for r in starts.values()}) == 1,
        "alone_requests_identical": len({tuple(r["alone_texts"]) for r in starts.values()}) == 1,
        "burst_streams_identical_to_d": {
            k: sum(x == y for x, y in zip(r["burst_texts"], d["burst_texts"]))
            for k, r in starts.items()
            if k != "d"
        }
        if d
        else None,
    }
    report["medians"] = {
        mode: {m: statistics.median(r[m] for r in runs_of(runs, mode)) for m in MEASURES}
        for mode in MODES
        if runs_of(runs, mode)
    }
    med = report["medians"]
    if "d" in med:
        report["targets"] = {
            k: {
                "first_token_within_0.3s_of_d": med[k]["first_token_s"] - med["d"]["first_token_s"]
                <= 0.3,
                "ttft_p99_within_1.2x": med[k]["ttft_p99_s"] <= 1.2 * med["d"]["ttft_p99_s"],
                "pause_within_1.2x": med[k]["median_longest_pause_s"]
                <= 1.2 * med["d"]["median_longest_pause_s"],
            }
            for k in ("b", "c")
            if k in med
        }


def print_table(report: dict) -> None:
    print(
        f"\n{report['device']}, {report['date']}, {report['config']} bf16, "
        f"max-model-len {report['max_model_len']}; medians over {report['rounds']} round(s)"
    )
    print(
        f"{'':26}{'first token':>12}{'TTFT p99':>10}{'longest pause':>15}"
        "   each start's first token"
    )
    for mode, label in MODES.items():
        m = report["medians"].get(mode)
        if m:
            each = " ".join(f"{r['first_token_s']:.2f}" for r in runs_of(report["runs"], mode))
            print(
                f"{label:26}{m['first_token_s']:>11.2f}s{m['ttft_p99_s']:>9.2f}s"
                f"{m['median_longest_pause_s']:>14.3f}s   {each}"
            )
    print("tokens:", json.dumps(report["tokens"]), "\ntargets:", json.dumps(report.get("targets")))


if __name__ == "__main__":
    main()
