"""Data over the wire: what a child may send the grader, as plain JSON, and its decoding in the grader."""
from __future__ import annotations

import json
import numbers
from collections import deque

class Opaque:
    """A returned value that is not data (an object of the student's): only its type and repr cross over."""

    def __init__(self, type_name: str, text: str):
        self.opaque_type, self.text = type_name, text

    def __repr__(self) -> str:
        return f"<{self.opaque_type}: {self.text}>"


TENSOR_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
MAX_WIRE_ITEMS = 2_000_000


def to_wire(value, depth: int = 0):
    """A value as plain JSON data. Subclasses become their base type, so no object crosses with its methods
    (an `__eq__` that is always True stays behind)."""
    if depth > 30:
        return {"object": {"type": "too deeply nested", "repr": ""}}
    if value is None or isinstance(value, str) and type(value) is str:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if type(value).__name__ == "Tensor" and type(value).__module__.startswith("torch"):
        t = value.detach().cpu()
        return {"tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "data": t.flatten().tolist()}}
    if isinstance(value, tuple):
        return {"tuple": [to_wire(x, depth + 1) for x in value]}
    if isinstance(value, (list, deque)):
        return [to_wire(x, depth + 1) for x in value]
    if isinstance(value, dict):
        return {"dict": [[to_wire(k, depth + 1), to_wire(v, depth + 1)] for k, v in value.items()]}
    try:
        text = repr(value)[:200]
    except Exception:
        text = "(its repr failed)"
    return {"object": {"type": type(value).__name__, "repr": text}}


def from_wire(data):
    """Decode what to_wire wrote; anything else raises ValueError. Runs in the grader on what a child sent."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_wire(x) for x in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(from_wire(x) for x in body)
        if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            pairs = [(from_wire(k), from_wire(v)) for k, v in body]
            if all(isinstance(k, (str, int, float, bool, tuple)) or k is None for k, _ in pairs):
                return dict(pairs)
        if tag == "tensor" and isinstance(body, dict):
            return _tensor_from_wire(body)
        if tag == "object" and isinstance(body, dict):
            return Opaque(str(body.get("type"))[:100], str(body.get("repr"))[:200])
    raise ValueError(f"not the grader's encoding: {str(data)[:100]}")


def _tensor_from_wire(body: dict):
    import torch
    dtype, shape, values = body.get("dtype"), body.get("shape"), body.get("data")
    if (dtype not in TENSOR_DTYPES or not isinstance(shape, list) or not isinstance(values, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            or len(values) > MAX_WIRE_ITEMS or not all(isinstance(x, (int, float, bool)) for x in values)):
        raise ValueError("not the grader's encoding of a tensor")
    count = 1
    for n in shape:
        count *= n
    if count != len(values):
        raise ValueError(f"a tensor of shape {shape} cannot hold {len(values)} values")
    return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)


def over_the_wire(value):
    """What the grader would see of `value`: pytest passes outputs through this too, so both judge the same data."""
    return from_wire(json.loads(json.dumps(to_wire(value))))


def changed_inputs(sent, inputs: dict) -> list[str]:
    """The names of the inputs that a call changed: `sent` is how the inputs were (to_wire of the dict), `inputs`
    what they are now. A region must leave its inputs as it found them: the engine keeps using them (the logits
    it masks)."""
    before = dict(sent["dict"]) if isinstance(sent, dict) and isinstance(sent.get("dict"), list) else {}
    return [name for name, value in inputs.items()
            if json.dumps(to_wire(value), allow_nan=True) != json.dumps(before.get(name), allow_nan=True)]


def parse_messages(data: bytes) -> tuple[list[dict], int]:
    """The JSON objects, one per line, and how many lines were something else."""
    messages, stray = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if isinstance(message, dict):
            messages.append(message)
        else:
            stray += 1
    return messages, stray
