"""The consumer side of the wire: `ZmqClient` pulls from any number of owners.

One I/O thread owning one DEALER socket per owner carries `Transfer`s (many at a time, what
asyncio callers use), and blocking calls drive a connection of their own in the caller's thread
(two thread hand-offs fewer per round trip); a same-host ref is read straight from the owner's
segment while its generation word says the segment still holds it (no round trip).
On the authenticated plane, unless its `BulkMode` is `encrypted`, a TCP pull asks for the owner's
bulk channel: the chunks come over a plain socket of the owner's under a one-time grant
(`engine.data.bulk`), in `mac` mode each checked against its MAC as it is copied.
`engine.data.peer.Peer` bundles it with a tensor server.

* `zmq_client`: `ZmqClient`, the public face; it owns what the paths share and picks one per call.
* `in_place`: `InPlaceReader`, same-host refs read from the owner's segment.
* `loop`: `IOLoop`, the background I/O thread behind `pull` and `call`.
* `direct`: `DirectLinks`, the blocking calls (`fetch*`, `request`) in the caller's thread.
* `sockets`: `OwnerSockets`, the sockets both paths open to owners; `config`: `ClientConfig`.
Each module's docstring says how a request flows through it and how it fails.
"""

from engine.data.client.config import ClientConfig
from engine.data.client.zmq_client import ZmqClient

__all__ = ["ClientConfig", "ZmqClient"]
