"""The RunPod Hub's documented schema for hub.json and tests.json, as JSON Schema (validated with
`jsonschema`).

Source: RunPod's docs, hub/publishing-guide.mdx ("hub.json reference", "tests.json reference" and
the templates) and references/gpu-types.mdx (GPU IDs and pools), runpod/docs at a900806
(2026-08-20). CUDA versions: those the guide's templates and the Flash configuration reference
(flash/configuration/parameters.mdx) list, and 13.0, which RunPod's own worker-vllm listing
(.runpod/hub.json, runpod-workers/worker-vllm 7a92503) uses.
"""

from __future__ import annotations

GPU_POOLS = {
    "AMPERE_16",
    "AMPERE_24",
    "ADA_24",
    "AMPERE_48",
    "ADA_48_PRO",
    "AMPERE_80",
    "ADA_80_PRO",
    "HOPPER_141",
}
GPU_IDS = {
    "AMD Instinct MI300X OAM",
    "NVIDIA A100 80GB PCIe",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA A30",
    "NVIDIA A40",
    "NVIDIA B200",
    "NVIDIA B300 SXM6 AC",
    "NVIDIA GeForce RTX 3070",
    "NVIDIA GeForce RTX 3080",
    "NVIDIA GeForce RTX 3080 Ti",
    "NVIDIA GeForce RTX 3090",
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 4070 Ti",
    "NVIDIA GeForce RTX 4080",
    "NVIDIA GeForce RTX 4080 SUPER",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA GeForce RTX 5080",
    "NVIDIA GeForce RTX 5090",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 NVL",
    "NVIDIA H100 PCIe",
    "NVIDIA H200",
    "NVIDIA H200 NVL",
    "NVIDIA L4",
    "NVIDIA L40",
    "NVIDIA L40S",
    "NVIDIA RTX 2000 Ada Generation",
    "NVIDIA RTX 4000 Ada Generation",
    "NVIDIA RTX 4000 SFF Ada Generation",
    "NVIDIA RTX 5000 Ada Generation",
    "NVIDIA RTX 6000 Ada Generation",
    "NVIDIA RTX A2000",
    "NVIDIA RTX A4000",
    "NVIDIA RTX A4500",
    "NVIDIA RTX A5000",
    "NVIDIA RTX A6000",
    "NVIDIA RTX PRO 4500 Blackwell",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 1g.24gb",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 2g.48gb",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "Tesla V100-PCIE-16GB",
    "Tesla V100-SXM2-16GB",
    "Tesla V100-SXM2-32GB",
}
CUDA_VERSIONS = {
    "11.1",
    "11.4",
    "11.7",
    "11.8",
    "12.0",
    "12.1",
    "12.2",
    "12.3",
    "12.4",
    "12.5",
    "12.6",
    "12.7",
    "12.8",
    "13.0",
}
CATEGORIES = ["audio", "embedding", "language", "video", "image"]

_STRING = {"type": "string", "minLength": 1}
_OPTION = {
    "type": "object",
    "required": ["label", "value"],
    "additionalProperties": False,
    "properties": {"label": {"type": "string"}, "value": {"type": "string"}},
}
_INPUT_COMMON = {
    "name": _STRING,
    "description": {"type": "string"},
    "advanced": {"type": "boolean"},
    "required": {"type": "boolean"},
}


def _input(kind: dict, **extra) -> dict:
    """One input form of the guide's "Environment variables" section."""
    return {
        "type": "object",
        "required": ["name", "type", "description"],
        "additionalProperties": False,
        "properties": {**_INPUT_COMMON, "type": kind, **extra},
    }


ENV_ENTRY = {
    "type": "object",
    "required": ["key"],
    "properties": {"key": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]*$"}},
    "oneOf": [
        # 1. a static variable
        {
            "required": ["value"],
            "properties": {"value": {"type": "string"}},
            "not": {"required": ["input"]},
        },
        {
            "required": ["input"],
            "not": {"required": ["value"]},
            "properties": {
                "input": {
                    "oneOf": [
                        # 2./3. string and Hugging Face inputs
                        _input({"enum": ["string", "huggingface"]}, default={"type": "string"}),
                        # 4. option inputs: a string with options
                        _input(
                            {"const": "string"},
                            options={"type": "array", "minItems": 1, "items": _OPTION},
                            default={"type": "string"},
                        )
                        | {"required": ["name", "type", "description", "options"]},
                        # 5. number inputs
                        _input(
                            {"const": "number"},
                            min={"type": "number"},
                            max={"type": "number"},
                            default={"type": "number"},
                        ),
                        # 6. boolean inputs
                        _input(
                            {"const": "boolean"},
                            default={"type": "boolean"},
                            trueValue={"type": "string"},
                            falseValue={"type": "string"},
                        ),
                    ]
                }
            },
        },
    ],
}

HUB_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["title", "description", "type", "category", "config"],
    "additionalProperties": False,
    "properties": {
        "title": _STRING,
        "description": _STRING,
        "type": {"const": "serverless"},
        "category": {"enum": CATEGORIES},
        "iconUrl": {"type": "string", "pattern": "^https?://"},
        "config": {
            "type": "object",
            "required": ["runsOn", "containerDiskInGb"],
            "additionalProperties": False,
            "properties": {
                "runsOn": {"enum": ["GPU", "CPU"]},
                "endpointType": {"const": "LB"},
                "containerDiskInGb": {"type": "integer", "minimum": 1},
                "cpuFlavor": _STRING,
                "gpuCount": {"type": "integer", "minimum": 1},
                "gpuIds": _STRING,
                "allowedCudaVersions": {"type": "array", "items": {"enum": sorted(CUDA_VERSIONS)}},
                "env": {"type": "array", "items": ENV_ENTRY},
                "presets": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "defaults"],
                        "additionalProperties": False,
                        "properties": {
                            "name": _STRING,
                            "defaults": {
                                "type": "object",
                                "additionalProperties": {"type": ["string", "number", "boolean"]},
                            },
                        },
                    },
                },
            },
            "if": {"properties": {"runsOn": {"const": "GPU"}}},
            "then": {"required": ["gpuCount", "gpuIds"]},
            "else": {"required": ["cpuFlavor"]},
        },
    },
}

TESTS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["tests", "config"],
    "additionalProperties": False,
    "properties": {
        "tests": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "input"],
                "additionalProperties": False,
                "properties": {
                    "name": _STRING,
                    "input": {"type": "object"},
                    "timeout": {"type": "integer", "minimum": 1},
                },
            },
        },
        "config": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "gpuTypeId": {"enum": sorted(GPU_IDS)},
                "gpuCount": {"type": "integer", "minimum": 1},
                "cpuFlavor": _STRING,
                "env": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["key", "value"],
                        "additionalProperties": False,
                        "properties": {"key": _STRING, "value": {"type": "string"}},
                    },
                },
                "allowedCudaVersions": {"type": "array", "items": {"enum": sorted(CUDA_VERSIONS)}},
            },
            "anyOf": [{"required": ["gpuTypeId", "gpuCount"]}, {"required": ["cpuFlavor"]}],
        },
    },
}


def gpu_id_errors(gpu_ids: str) -> list[str]:
    """gpuIds: comma-separated pool IDs, with optional negations of single GPU IDs ("-NVIDIA GeForce
    RTX 4090")."""
    errors = []
    for item in gpu_ids.split(","):
        if item.startswith("-"):
            if item[1:] not in GPU_IDS:
                errors.append(f"{item!r}: not a GPU ID")
        elif item not in GPU_POOLS:
            errors.append(f"{item!r}: not a GPU pool ID")
    return errors
