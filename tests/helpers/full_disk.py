"""A ``sitecustomize`` that makes a process's checkpoint writes of one step fail as on a full
disk: DeepSpeed's ``torch.save`` to a path naming the step raises torch's ``unexpected pos``, and
DCP's item writes into it raise ``ENOSPC`` (FSDP2). Put the folder :func:`full_disk_site` writes
first on ``PYTHONPATH`` and name the step in ``DATC_TEST_FULL_DISK_AT`` (``step_0000004``)."""

from __future__ import annotations

from pathlib import Path

SITE = '''
import os
AT = os.environ.get("DATC_TEST_FULL_DISK_AT")
if AT:
    import errno
    import torch
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and AT in str(f):
            with open(f, "wb") as out:
                out.write(b"PK partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6912 vs 6804")
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    import torch.distributed.checkpoint.filesystem as fs
    real_item = fs._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if AT in str(getattr(stream, "name", "")):
            stream.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_item(transforms, stream, *args, **kwargs)

    fs._write_item = write_item
'''


def full_disk_site(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITE)
    return folder
