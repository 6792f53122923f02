""" Writing results: atomic files and folders, safetensors weights, and the check that an output holds none yet

A file or a folder is either complete or not there (or still the one it replaces): everything is written under a
hidden temporary name beside its destination, on the same file system, and renamed into place once complete; a
failure removes the temporary and leaves the destination as it was. `refuse_existing_output` is the check, before
any work starts, that a run would not overwrite earlier results.
"""
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
from safetensors.torch import save_file

from .errors import OutputExistsError

__all__ = ['atomic_write', 'atomic_dir', 'save_safetensors', 'refuse_existing_output']

PathLike = Union[str, os.PathLike]


def _sibling(path: Path, kind: str) -> Path:
    """A new hidden name beside `path`, for a file or folder being written or replaced."""
    return path.with_name(f'.{path.name}.{uuid.uuid4().hex[:8]}.{kind}')


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def atomic_write(path: PathLike, content: Union[bytes, str, Callable[[str], None]]) -> None:
    """ Write `content` to `path` atomically: bytes, text (UTF-8), or a callback that writes the file whose path it
    is given (e.g. `lambda tmp: safetensors.torch.save_file(tensors, tmp)`); a callback that raises leaves nothing.
    """
    path = Path(path)
    tmp = _sibling(path, 'tmp')
    try:
        if callable(content):
            content(str(tmp))
        else:
            with open(tmp, 'wb') as f:
                f.write(content.encode('utf-8') if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            _remove(tmp)


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: PathLike) -> None:
    """ Write `tensors` (a state dict) to the safetensors file `path` atomically, as contiguous CPU copies.

    safetensors stores one memory layout and refuses any other, so the weights of a channels-last model
    (`model.to(memory_format=torch.channels_last)`, `--channels-last`) are written in the standard one; loading
    them into a model of either layout gives the same values.
    """
    contiguous = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    atomic_write(path, lambda tmp: save_file(contiguous, tmp))


@contextmanager
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """ Yield a new temporary folder that replaces `path` once the block completes (an existing `path` is moved
    aside first and deleted after); if the block raises, the temporary folder is deleted and `path` left as it was.
    """
    path = Path(path)
    tmp = _sibling(path, 'tmp')
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = _sibling(path, 'old')
            path.rename(old)
            tmp.rename(path)
            _remove(old)
        else:
            tmp.rename(path)
    finally:
        if tmp.exists():
            _remove(tmp)


def refuse_existing_output(path: PathLike, flag: str = '--overwrite', names: Optional[Iterable[str]] = None) -> None:
    """ Raise `OutputExistsError` (a `FileExistsError`) if `path` holds earlier results: any entry, or one of
    `names` when the run writes only those files into a folder that may hold others. Call it before any work
    starts, unless told to overwrite; `flag` is what the message tells the user to pass to replace them.
    """
    path = Path(path)
    if names is not None:
        found = [name for name in names if (path / name).exists()]
    else:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else ([path.name] if path.exists() else [])
    if found:
        shown = ', '.join(found[:5]) + (f' and {len(found) - 5} more' if len(found) > 5 else '')
        raise OutputExistsError(f'{path} holds earlier results ({shown}); pass {flag} to replace them, '
                                'or choose another --output.')
