"""Crafted pickles, as someone who can write a checkpoint would make them: each would run a command (touch a marker
file) in a plain `pickle.loads`, by a different road. The readers of files from storage must refuse every one."""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import zipfile

import torch


def _text(s: str) -> bytes:
    """SHORT_BINUNICODE or BINUNICODE: a string pushed on the unpickler's stack."""
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + struct.pack("<I", len(b))) + b


class _Reduce:
    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def crafted(marker: str) -> dict[str, bytes]:
    """Name -> a pickle that, loaded by plain `pickle.loads`, creates `marker`."""
    touch = f"touch {marker}"
    return {
        "os.system": pickle.dumps(_Reduce(os.system, touch)),
        # the road the old allow-list left open: a dotted name through a module it allowed by name
        "dotted name through an allowed module": b"\x80\x04"
        + _text("torch.distributed.checkpoint.filesystem")
        + _text("os.system")
        + b"\x93"
        + _text(touch)
        + b"\x85R.",
        "builtins.eval": pickle.dumps(_Reduce(eval, f"__import__('os').system({touch!r})")),
        "subprocess": pickle.dumps(_Reduce(subprocess.check_call, ["touch", marker])),
        "getattr chain": b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\n"
        + _text("os")
        + b"\x85R"
        + _text("system")
        + b"\x86R"
        + _text(touch)
        + b"\x85R.",
        "protocol 0 GLOBAL": f"cos\nsystem\n(V{touch}\ntR.".encode(),
        "INST opcode": f"(V{touch}\nios\nsystem\n.".encode(),
        "OBJ opcode": f"(cos\nsystem\nV{touch}\no.".encode(),
        "call inside a DCP metadata": _inside_metadata(touch),
    }


def _inside_metadata(touch: str) -> bytes:
    """A real DCP Metadata whose one entry's size is the result of os.system: allowed classes around a call."""
    from torch.distributed.checkpoint.metadata import Metadata

    body = pickle.dumps(Metadata(state_dict_metadata={"x": _Reduce(os.system, touch)}), protocol=4)
    return body


def refused_only(directory_file: str) -> dict[str, bytes]:
    """Pickles built of the very classes a DCP metadata holds, that no save writes: a read pointed outside the
    checkpoint, an entry of pickled bytes (which DCP loads with torch.load(weights_only=False)), a transform."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])

    def pointing(info: _StorageInfo) -> bytes:
        return pickle.dumps(Metadata({"model.w": tensor}, storage_data={MetadataIndex("model.w", [0]): info}))

    huge = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([10**12]), [chunk])
    stored = {MetadataIndex("model.w", [0]): _StorageInfo("__0_0.distcp", 0, 64)}
    return {
        "a read outside the checkpoint": pointing(_StorageInfo(directory_file, 0, 10)),
        "a read of a file the commit does not list": pointing(_StorageInfo("__7_0.distcp", 0, 64)),
        "a tensor larger than its bytes": pickle.dumps(
            Metadata(
                {"model.w": huge}, storage_data={MetadataIndex("model.w", [0]): _StorageInfo("__0_0.distcp", 0, 64)}
            )
        ),
        "a size that is not a torch.Size": pickle.dumps(
            Metadata(
                {"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), [4], [chunk])},
                storage_data=stored,
            )
        ),
        "a transform": pointing(_StorageInfo("__0_0.distcp", 0, 10, ["zstd/1"])),
        "an entry of pickled bytes": pickle.dumps(Metadata({"model.w": BytesStorageMetadata()})),
        "not a Metadata": pickle.dumps(torch.Size([1, 2])),
        "a persistent id": b"\x80\x02" + _text("x") + b"Q.",
        "an extension code": b"\x80\x02\x82\x01.",
        "garbage": b"\x00\x01 not a pickle",
    }


def in_torch_file(body: bytes) -> bytes:
    """A torch.save file (zip) whose data.pkl is `body`: what torch.load reads."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = body if item.filename.endswith("/data.pkl") else src.read(item)
            dst.writestr(item, data)
    return out.getvalue()
