"""Where the examples' data comes from, and a clear error when it cannot be had.

Each example reads a local directory (``--data.data_dir=DIR``, written by its ``prepare.py``), a Hugging Face Hub
dataset (``--data.dataset_name=NAME``) or the small subset shipped in the repository. When the directory is missing
or the Hub cannot be reached, :class:`DataUnavailableError` says which flag to change and which ``prepare`` command
writes the files, and it says so within seconds: the Hub is probed with one request and a short timeout instead of
letting ``datasets`` retry for half a minute, and with ``HF_HUB_OFFLINE=1`` only the local cache is looked at.
"""

from collections.abc import Sequence
from pathlib import Path

import datasets

HUB_TIMEOUT = 10.0
"""Seconds the Hub probe waits for an answer."""


class DataUnavailableError(RuntimeError):
    """The data an example was asked for cannot be read: a missing directory, or a Hub dataset out of reach."""


def hub_offline() -> bool:
    """Whether Hugging Face offline mode is on (``HF_HUB_OFFLINE=1``, or ``HF_DATASETS_OFFLINE=1``)."""
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE or getattr(datasets.config, "HF_HUB_OFFLINE", False))


def missing_files(directory: str | Path, files: Sequence[str]) -> list[str]:
    """The ``files`` not present in ``directory`` (all of them when the directory itself is missing)."""
    return [name for name in files if not (Path(directory) / name).is_file()]


def check_directory(directory: str | Path, files: Sequence[str], advice: str, flag: str = "--data.data_dir") -> None:
    """Raise :class:`DataUnavailableError` unless ``directory`` holds every one of ``files``.

    Args:
        directory: the ``--data.data_dir`` given.
        files: file names it must hold.
        advice: what to do instead (the ``prepare`` command and the flags), appended to the message.
        flag: the option that gave ``directory``, named in the message.
    """
    missing = missing_files(directory, files)
    if not missing:
        return
    path = Path(directory).resolve()
    what = "does not exist" if not path.is_dir() else f"has no {', '.join(missing)}"
    raise DataUnavailableError(f"{flag}={directory} ({path}) {what}.\n{advice}")


def check_hub(name: str, advice: str, flag: str = "--data.dataset_name") -> None:
    """Raise :class:`DataUnavailableError`, fast, when the Hub dataset ``name`` cannot be loaded.

    Online, one metadata request with a :data:`HUB_TIMEOUT` timeout: a network error means the machine is probably
    offline, a "repository not found" answer that the name is wrong. In offline mode (``HF_HUB_OFFLINE=1``), the
    dataset must already be in the local Hugging Face cache.

    Args:
        name: the ``--data.dataset_name`` given.
        advice: what to do instead, appended to the message.
        flag: the option that gave ``name``, named in the message.
    """
    flag = f"{flag}={name}"
    if hub_offline():
        try:
            datasets.load_dataset_builder(name)
        except Exception as error:
            raise DataUnavailableError(
                f"{flag}: HF_HUB_OFFLINE is set and the Hugging Face cache holds no copy of {name!r} "
                f"({type(error).__name__}: {error}).\n{advice}"
            ) from error
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=HUB_TIMEOUT)
    except RepositoryNotFoundError as error:
        raise DataUnavailableError(f"{flag}: the Hugging Face Hub has no dataset {name!r}.\n{advice}") from error
    except HfHubHTTPError:
        return  # the Hub answered (gated, rate limited, ...): let `datasets` report what it needs
    except Exception as error:
        raise DataUnavailableError(
            f"{flag}: the Hugging Face Hub cannot be reached, the machine may be offline "
            f"({type(error).__name__}: {error}).\n{advice}"
        ) from error


def load_hub(name: str, advice: str, flag: str = "--data.dataset_name") -> datasets.DatasetDict:
    """``datasets.load_dataset(name)``, its failures re-raised as :class:`DataUnavailableError` with ``advice``."""
    try:
        return datasets.load_dataset(name)
    except Exception as error:
        raise DataUnavailableError(
            f"{flag}={name}: could not load it from the Hugging Face Hub ({type(error).__name__}: "
            f"{error}); the machine may be offline.\n{advice}"
        ) from error
