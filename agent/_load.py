"""What the tool and the interaction layers share: reading their verl config files (a YAML mapping
with one list of entries, its interpolations resolved as verl's OmegaConf resolves them), loading
an entry's class by import path, and running a batch of coroutines in an event loop: a fresh one
per batch, or a rollout's own (`EventLoop`).

The errors name the file, the entry and the key, and are raised as the caller's error class
(`ToolConfigError`, `InteractionConfigError`) so that each layer's users catch one type.
"""

from __future__ import annotations

import asyncio
import importlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml

from trainer.configlib import ConfigError, load_yaml_text, resolve_document


def read_entries(path: str, section: str, what: str, config_key: str, error: type[Exception]) -> list:
    """The non-empty list under `section` of the YAML file `path`, the only top-level key it may
    have. `what` names the file's kind in messages ("tool config"), `config_key` the setting that
    points at it."""
    try:
        with open(path, "rb") as f:
            # decoded whole: the error's offset is the file's; numbers read as verl (OmegaConf) reads them
            doc = load_yaml_text(f.read().decode("utf-8"))
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({config_key}): {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise error(f"{path}: the {what} ({config_key}) is not valid UTF-8 ({err.reason} at byte offset "
                    f"{err.start}); save it as UTF-8") from err
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {err}") from err
    if not isinstance(doc, dict) or section not in doc:
        raise error(f"{path}: must be a mapping with a '{section}' list, got {type(doc).__name__}"
                    + (f" with keys {list(doc)}" if isinstance(doc, dict) else ""))
    extra = [k for k in doc if k != section]
    if extra:
        raise error(f"{path}: unknown top-level keys {extra}; {what} files hold only '{section}'")
    entries = doc[section]
    if not isinstance(entries, list) or not entries:
        raise error(f"{path}: {section}: must be a non-empty list, got {entries!r}")
    try:  # verl reads the file with OmegaConf and resolves it: `${oc.env:URL}` reaches the tool as the URL
        return [resolve_document(entry, f"{section}[{i}]") for i, entry in enumerate(entries)]
    except ConfigError as err:
        raise error(f"{path}: {err}") from None


def load_class(class_name: Any, key: str, base: type, verl_classes: dict[str, type], kind: str,
               error: type[Exception]) -> type:
    """The subclass of `base` that `class_name` names: one of verl's that meshppo provides
    (`verl_classes`, verl's import path to meshppo's class) or `package.module.Class`. `key` is the
    entry's `class_name` key for messages, `kind` what the classes are ("tools")."""
    if isinstance(class_name, str) and class_name in verl_classes:
        return verl_classes[class_name]
    parts = class_name.split(".") if isinstance(class_name, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise error(f"{key}: must be a dotted import path (package.module.Class), got {class_name!r}")
    module_name, attr = class_name.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        hint = (f"; of verl's {kind} meshppo provides {list(verl_classes)}" if class_name.startswith("verl.")
                else "")
        raise error(f"{key}: cannot import module {module_name!r}: {type(err).__name__}: {err}{hint}") from err
    cls = getattr(module, attr, None)
    if cls is None:
        raise error(f"{key}: module {module_name!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise error(f"{key}: {class_name} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def run(coroutine, loop: "EventLoop | None" = None):
    """Run `coroutine` to the end: in `loop` when given, else in a new event loop, in this thread
    when it has none running (the trainer's case), else in a worker thread (asyncio.run cannot
    nest), waiting for the result."""
    if loop is not None:
        return loop.run(coroutine)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class EventLoop:
    """One rollout's event loop: its tools' and interactions' coroutines run in it as tasks from
    one engine step to the next (`spawn`, `settle`, `wait_first`), and their objects may stay bound
    to it for the whole rollout. It runs only inside this object's calls: in this thread, or in a
    worker thread when this thread already runs a loop. `close()` cancels what is left."""

    SETTLE_PASSES = 16  # loop passes of `settle`: a coroutine that awaits no I/O (a gather of them) ends within

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        try:
            asyncio.get_running_loop()
            self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1)
        except RuntimeError:
            self._pool = None

    def run(self, coroutine):
        if self._pool is None:
            return self.loop.run_until_complete(coroutine)
        return self._pool.submit(self.loop.run_until_complete, coroutine).result()

    def spawn(self, coroutine) -> asyncio.Task:
        """A task of `coroutine`; it starts at the next `settle`, `wait_first` or `run`."""
        return self.loop.create_task(coroutine)

    def settle(self) -> None:
        """Let the tasks run as far as they can without waiting: a task that awaits no I/O or timer
        ends here, so when it ends does not depend on the host's speed."""
        async def passes():
            for _ in range(self.SETTLE_PASSES):
                await asyncio.sleep(0)

        self.run(passes())

    def wait_first(self, tasks) -> None:
        """Block until one of `tasks` has ended."""
        self.run(asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED))

    def close(self) -> None:
        left = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in left:
            t.cancel()
        if left:
            self.run(asyncio.gather(*left, return_exceptions=True))
        self.loop.close()
        if self._pool is not None:
            self._pool.shutdown()


def cancelled_from_outside() -> bool:
    """Whether the asyncio.CancelledError being handled cancels the running task (the event loop closing), not
    one that a tool's or interaction's code raised itself (a bug to report: it would end the task unseen)."""
    task = asyncio.current_task()
    return task is not None and bool(getattr(task, "cancelling", lambda: 1)())
