"""`python -m handler`: the RunPod worker; `python -m handler serve ...`: the OpenAI HTTP server;
`chat`: a local chat.

Worker flags are the runpod SDK's own (--rp_serve_api --rp_api_host H --rp_api_port N, --test_input
JSON, ...). The worker begins with the last start's weight stream, when the variables that chose it
are unchanged (cache.early_stream), then the settings, then the engine's start (the weights moving,
or adopting that stream), then its own imports (the job handling), made while the start makes the
GPU's context, which leaves the interpreter free, and before it imports torch, which waits for
them. The RunPod SDK gets a process of its own, started before anything else (handler.sdk_front), so
its import runs beside the start. The server starts its engine's process first thing
(handler.engine_process: the weights, `import torch` and the engine's build), and reads its
settings, imports Starlette and uvicorn and loads its tokenizer beside it (handler.engine_link).
"""

from __future__ import annotations

import argparse
import contextlib
import sys


def _settings(abandon):
    """The settings from the environment, or None when they are invalid (the entry point then
    reports them in its own words), after `abandon()` undid what began before them and the
    collector went back on (no start follows to turn it on)."""
    from handler.config import SettingsError, load_settings
    from warmup.start import release_gc

    try:
        return load_settings()
    except SettingsError:
        abandon()
        release_gc()
        return None


def begin(entry: str):
    """The settings, logging, and the engine's start (warmup.start's sequence, through EngineBoot):
    returns the started EngineBoot once the weights are moving, or None when the settings are
    invalid."""
    from cache.device_stream import cancel_early
    from handler.engine_boot import begin as begin_boot

    # a stream begun from the last start's record: no start takes it when the settings are invalid
    settings = _settings(cancel_early)
    return None if settings is None else begin_boot(settings, entry)


def begin_engine_process(process):
    """`serve`'s start, once its engine's process runs (handler.engine_process: the last start's
    weights and `import torch` begin there at once): the settings here, sent to it; returns the
    RemoteBoot, or None when the settings are invalid (the engine's process is told to end)."""
    from handler import engine_link
    from handler.engine_boot import configure_logging
    from warmup.start import release_gc

    settings = _settings(process.close)
    if settings is None:
        return None
    configure_logging(settings)
    boot = engine_link.RemoteBoot(settings, process)
    release_gc()  # this process imports no torch: its collector goes back on once it has read them
    return boot


def import_entry(entry: str, boot) -> None:
    """The entry point's own heavy imports (its module, and what that module imports late), in the
    start's turn when a start is running: while it makes the GPU's context, before `import torch`
    (EngineBoot.entry_imports)."""
    with boot.entry_imports() if boot is not None else contextlib.nullcontext():
        if entry == "serve":
            import uvicorn  # noqa: F401

            import handler.server  # noqa: F401
        else:
            import handler.worker  # noqa: F401


def chat(argv: list[str]) -> None:
    """Chat on stdin with MODEL_NAME (or the embedded demo model), greedy by default."""
    ap = argparse.ArgumentParser(prog="python -m handler chat", description=chat.__doc__)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompt", help="answer this one message and exit")
    args = ap.parse_args(argv)

    from engine import SamplingParams
    from handler.config import load_settings
    from handler.engine_boot import EngineBoot

    engine = EngineBoot(load_settings()).load_blocking()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    history: list[dict] = []

    async def answer() -> str:
        text = ""
        async for out in engine.chat(f"chat-{len(history)}", history, params):
            text = out.outputs[0].text
        return text

    while True:
        if args.prompt is None:
            try:
                line = input("you> ")
            except EOFError:
                return
        else:
            line = args.prompt
        if line.strip():
            history.append({"role": "user", "content": line})
            import asyncio

            reply = asyncio.run(answer())
            history.append({"role": "assistant", "content": reply})
            print(reply if args.prompt is not None else f"model> {reply}", flush=True)
        if args.prompt is not None:
            return


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    helping = bool({"-h", "--help"} & set(argv))
    process = None
    if argv[:1] == ["serve"] and not helping:
        from handler.engine_link import EngineProcess

        process = EngineProcess()  # first thing: the engine's start begins there at once
    from cache import early_stream
    from warmup.start import hold_gc

    hold_gc()  # the cyclic GC stays off until the engine's start ends (warmup.start)
    if argv[:1] == ["serve"]:
        boot = None if process is None else begin_engine_process(process)
        import_entry("serve", boot)
        from handler.server import main as serve

        serve(argv[1:], boot=boot)
    elif argv[:1] == ["chat"]:
        chat(argv[1:])
    elif argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
    else:
        from handler import front_link

        # first: the SDK's import (a second or more) runs in its own process beside the start
        sdk = front_link.SdkProcess(argv) if front_link.wants_sdk_process(argv) else None
        if sdk is not None:
            from cache import start_pages

            start_pages.expect_files()  # it sends what it imported: the start pages wait for them
        # the SDK's local API (--rp_serve_api) imports a web server the job queue's loop does not:
        # its own start-page record
        entry = "worker-api" if "--rp_serve_api" in argv else "worker"
        early_stream.begin(entry)  # the last start's weights, before the settings' import
        boot = begin(entry)
        if boot is not None and sdk is not None:
            sdk.configure(boot.settings.log_level, boot.settings.max_concurrency)
        import_entry("worker", boot)
        from handler.worker import main as worker

        worker(argv, boot=boot, sdk=sdk)


if __name__ == "__main__":
    main()
