"""kombu's filesystem transport (the embedded broker) with each message written atomically.

kombu 5.7 writes a message file in place: ``open`` (an empty file with its final name), then
``write``. A consumer that lists the folder in between moves the empty file away, reads
nothing, and its ``json.loads`` raises out of Celery's consumer loop: the worker dies and
the message is lost. Polling every 50 ms (core/infra/broker.py) made that window easy to hit on
a loaded machine. Here the message is written under a name the consumer skips and renamed
into place (atomic within one folder), so a consumer sees a whole message or none.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

# A suffix after kombu's "<queue>.msg": its _get compares the whole tail and skips the file.
_PARTIAL = ".partial"


class Channel(filesystem.Channel):  # type: ignore[misc]
    # kombu declares _put twice, with different parameter names (message, payload).
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # kombu's name: consumers take messages in the order of the leading milliseconds.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + _PARTIAL
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):  # type: ignore[misc]
    Channel = Channel
