"""Clone to the first answer, as a new user gets it: `git clone`, then `make run`, and a client that
sends the README's request until the worker answers it. Prints the seconds of each step.

    python -m bench.clone_to_answer [--repo URL_OR_PATH] [--port 8000] [--out results.json]

Runs on the machine it is started on (CPU: the demo model). The clone goes to a temporary directory,
removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUEST = {
    "input": {
        "prompt": "The capital of France is",
        "sampling_params": {"max_tokens": 16, "temperature": 0},
    }
}


def ask(port: int) -> dict | None:
    """The README's /runsync request; its answer, or None while the worker is not up."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/runsync",
        data=json.dumps(REQUEST).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.load(resp)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repo", default=str(REPO), help="what to clone (default: this checkout)")
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", help="also write the times as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the clone")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="coldbrew-clone-"))
    clone = work / "coldbrew"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH") and not k.startswith(("MODEL_", "RUNPOD_"))
    }
    env["CACHE_DIR"] = str(work / "cache")  # a new user's empty model cache
    times: dict[str, float] = {}
    t0 = time.monotonic()
    subprocess.run(["git", "clone", "-q", args.repo, str(clone)], check=True)
    times["clone"] = time.monotonic() - t0
    log = open(work / "make-run.log", "w")
    proc = subprocess.Popen(
        ["make", "run", f"RUN_PORT={args.port}"],
        cwd=clone,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    answer = None
    try:
        while answer is None:
            if proc.poll() is not None:
                raise SystemExit(f"make run exited {proc.returncode}: see {work / 'make-run.log'}")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"no answer in {args.timeout:.0f} s")
            if "venv_built" not in times and (clone / ".venv" / ".run-installed").exists():
                times["venv_built"] = time.monotonic() - t0
            answer = ask(args.port)
            if answer is None:
                time.sleep(0.5)
        times["first_answer"] = time.monotonic() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    text = answer.get("output", [{}])[0].get("choices", [{}])[0].get("tokens", [""])
    result = {
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "status": answer.get("status"),
        "text": "".join(text),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
