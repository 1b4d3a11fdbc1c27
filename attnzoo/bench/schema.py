"""The JSON layouts of the benchmarks' results, checked by hand (no jsonschema dependency), and atomic
I/O: the kernel benchmark (``attnzoo bench``, ``validate``), the model benchmark (``--models``,
``validate_models``) and the per-call overhead benchmark (``--overhead``, ``validate_overhead``)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import OK, STATUSES
from .flops import MODES
from .result import SCHEMA

TOP_LEVEL = {"schema": str, "created": str, "environment": dict, "settings": dict, "methods": dict,
             "flop_conventions": dict, "results": list}
ROW = {"variant": str, "backend": str, "kind": str, "seq_len": int, "batch": int, "heads": int, "head_dim": int,
       "dtype": str, "mode": str, "causal": bool, "status": str, "flops": int}
ROW_OPTIONAL = {"reason": str, "resolved_backend": str, "shared_with": str, "time_s": dict, "tflops": float,
                "tokens_per_s": float, "peak_memory_bytes": int, "ratio_time_vs_sdpa": float,
                "ratio_memory_vs_sdpa": float, "first_call_s": float}
TIME_FIELDS = ("median", "p20", "p80", "min", "max", "mean", "std", "n")
ENVIRONMENT = ("date", "device_type", "device_name", "torch", "triton", "cuda", "cpu_model", "torch_threads")


def _type_ok(value, expected) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _check_fields(obj: dict, required: dict, optional: dict, where: str) -> None:
    for key, typ in required.items():
        if key not in obj or not _type_ok(obj[key], typ):
            raise ValueError(f"{where}.{key} must be a {typ.__name__}, got {obj.get(key)!r}")
    for key, typ in optional.items():
        if obj.get(key) is not None and not _type_ok(obj[key], typ):
            raise ValueError(f"{where}.{key} must be a {typ.__name__} or null, got {obj[key]!r}")


def _check_status(row: dict, time_key: str, where: str) -> None:
    """A known status; an ok row holds its timing statistics under ``time_key``, any other a reason."""
    if row["status"] not in STATUSES:
        raise ValueError(f"{where}.status must be one of {STATUSES}, got {row['status']!r}")
    if row["status"] == OK:
        t = row.get(time_key)
        if not isinstance(t, dict) or any(not _type_ok(t.get(f), float) for f in TIME_FIELDS):
            raise ValueError(f"{where}.{time_key} must hold {TIME_FIELDS} for a row with status 'ok'")
    elif not row.get("reason"):
        raise ValueError(f"{where}: a row with status {row['status']!r} must give a reason")


def validate(result: dict) -> dict:
    """Raise ValueError naming the first field that does not match the layout; return ``result``."""
    if not isinstance(result, dict):
        raise ValueError(f"a benchmark result must be a JSON object, got {type(result).__name__}")
    if "schema" in result and result["schema"] != SCHEMA:  # before the fields: a models/overhead result lacks some
        raise ValueError(f"benchmark result: schema must be {SCHEMA!r} (a kernel benchmark, `attnzoo bench`), got "
                         f"{result['schema']!r}")
    for key, typ in TOP_LEVEL.items():
        if key not in result or not _type_ok(result[key], typ):
            raise ValueError(f"benchmark result: '{key}' must be a {typ.__name__}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"benchmark result: schema must be {SCHEMA!r}, got {result['schema']!r}")
    for key in ENVIRONMENT:
        if key not in result["environment"]:
            raise ValueError(f"benchmark result: environment.{key} is missing")
    for i, row in enumerate(result["results"]):
        where = f"results[{i}]"
        _check_fields(row, ROW, ROW_OPTIONAL, where)
        if row["mode"] not in MODES:
            raise ValueError(f"{where}.mode must be one of {MODES}, got {row['mode']!r}")
        _check_status(row, "time_s", where)
        if row["status"] == OK and not row["time_s"]["min"] <= row["time_s"]["median"] <= row["time_s"]["max"]:
            raise ValueError(f"{where}.time_s: median must lie between min and max")
    return result


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_text(text: str, path) -> Path:
    """Write atomically: a temporary file in the same folder, given the usual permissions (mkstemp
    makes 0600 files; the plots beside it are 0644), then renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(result: dict, path) -> Path:
    """``write_text`` of the JSON; values JSON cannot hold (paths, dtypes) are written as their str()."""
    return write_text(json.dumps(result, indent=1, sort_keys=False, default=str) + "\n", path)


def _read(path) -> object:
    """The JSON of a saved result, or a ValueError naming the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"benchmark result {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"benchmark result {str(path)!r} is not valid JSON: {e}") from None


def load(path) -> dict:
    return validate(_read(path))


# -- the model benchmark (attnzoo bench --models) --------------------------------------------------
MODELS_SCHEMA = "attnzoo.bench.models/1"
MODELS_TOP_LEVEL = {"schema": str, "created": str, "environment": dict, "settings": dict, "methods": dict,
                    "models": dict, "results": list}
MODEL_ROW = {"model": str, "attention": str, "mode": str, "status": str, "unit": str, "batch": int, "seq_len": int,
             "items_per_step": int}
MODEL_ROW_OPTIONAL = {"reason": str, "items_per_s": float, "step_s": dict, "ratio_vs_own": float,
                      "host_ms_per_step": float, "op_host_ms_per_step": float, "launches_per_step": float,
                      "graph_launches_per_step": float,
                      "aten_ops_per_step": float, "host_waits_per_step": float, "device_ms_per_step": float,
                      "warmup_s": float, "parameters": int, "loss": float}


def validate_models(result: dict) -> dict:
    """Raise ValueError naming the first field of a model-benchmark result that does not match."""
    if not isinstance(result, dict) or result.get("schema") != MODELS_SCHEMA:
        raise ValueError(f"a model benchmark result must be a JSON object with schema {MODELS_SCHEMA!r}")
    _check_fields(result, MODELS_TOP_LEVEL, {}, "model benchmark result")
    for i, row in enumerate(result["results"]):
        where = f"results[{i}]"
        _check_fields(row, MODEL_ROW, MODEL_ROW_OPTIONAL, where)
        _check_status(row, "step_s", where)
        if row["status"] == OK and (not _type_ok(row.get("items_per_s"), float) or row["items_per_s"] <= 0):
            raise ValueError(f"{where}.items_per_s must be a number > 0 for a row with status 'ok'")
    return result


# -- the per-call overhead benchmark (attnzoo bench --overhead) ------------------------------------
OVERHEAD_SCHEMA = "attnzoo.bench.overhead/1"
OVERHEAD_ROW = {"group": str, "name": str, "reference": str, "status": str}
OVERHEAD_ROW_OPTIONAL = {"reason": str, "us": float, "reference_us": float, "ratio": float, "extra_us": float,
                         "p20_us": float, "p80_us": float, "ratio_p20": float, "ratio_p80": float, "rounds": int}


def validate_overhead(result: dict) -> dict:
    """Raise ValueError naming the first field of an overhead-benchmark result that does not match."""
    if not isinstance(result, dict) or result.get("schema") != OVERHEAD_SCHEMA:
        raise ValueError(f"an overhead benchmark result must be a JSON object with schema {OVERHEAD_SCHEMA!r}")
    _check_fields(result, {"schema": str, "created": str, "environment": dict, "settings": dict, "methods": dict,
                           "results": list}, {}, "overhead benchmark result")
    for i, row in enumerate(result["results"]):
        _check_fields(row, OVERHEAD_ROW, OVERHEAD_ROW_OPTIONAL, f"results[{i}]")
        if row["status"] == OK and not _type_ok(row.get("us"), float):
            raise ValueError(f"results[{i}].us must be a number for a row with status 'ok'")
        if row["status"] != OK and not row.get("reason"):
            raise ValueError(f"results[{i}]: a row with status {row['status']!r} must give a reason")
    return result


def load_any(path) -> dict:
    """A saved result of any of the three benchmarks, checked against its own layout."""
    data = _read(path)
    schema = data.get("schema") if isinstance(data, dict) else None
    return {MODELS_SCHEMA: validate_models, OVERHEAD_SCHEMA: validate_overhead}.get(schema, validate)(data)
