"""One fresh process of the cold-start benchmark's baselines: bare `import torch` + CUDA init, or HF
transformers' from_pretrained + a one-token generate. (coldbrew itself is measured through its real
entry points.)

`python bench/cold_start_child.py MODE MODEL_DIR PROMPT_LEN`, MODE: bare | bare-gc-off (the same
with Python's cyclic GC off, as coldbrew's start runs) | bare-gc-off-ctx (the same with the GPU's
primary context begun on a thread before `import torch`, as coldbrew's start does) | hf. Prints
one line, `RESULT {json}`, of wall-clock stamps (time.time()); the parent subtracts the moment it
spawned this process.
"""

import sys
import time

T_MAIN = time.time()  # the interpreter is up and this file runs: before any import of torch's
import json  # noqa: E402
import os  # noqa: E402

MODE, MODEL_DIR, PROMPT_LEN = sys.argv[1], sys.argv[2], int(sys.argv[3])
MODES = ("bare", "bare-gc-off", "bare-gc-off-ctx", "hf")
if MODE not in MODES:
    raise SystemExit(f"mode: {MODE!r} is not one of {', '.join(MODES)}")
stamps: dict = {"main": T_MAIN}
if MODE.startswith("bare-gc-off"):
    import gc

    gc.disable()
if MODE == "bare-gc-off-ctx":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cache import cuda_driver

    cuda_driver.begin_primary_context(0)

import torch  # noqa: E402

stamps["import_torch"] = time.time()
if MODE == "bare-gc-off-ctx":
    cuda_driver.primary_context(0)
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
stamps["cuda_init"] = time.time()
result: dict = {}

if MODE == "hf":
    import transformers

    stamps["imports"] = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.bfloat16, device_map="cuda"
    )
    torch.cuda.synchronize()
    stamps["engine_ready"] = time.time()
    prompt = [(1000 + 7 * i) % 30000 for i in range(PROMPT_LEN)]
    with torch.inference_mode():
        ids = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=1, do_sample=False
        )
    torch.cuda.synchronize()
    stamps["first_token"] = time.time()
    result["token"] = ids[0, -1:].tolist()

result.update(stamps=stamps, pid=os.getpid())
print("RESULT " + json.dumps(result), flush=True)
