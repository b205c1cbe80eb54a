"""A TCP forwarder the multi-node tests own: `python -m tests.tcp_forward LISTEN_HOST TARGET_HOST:PORT`
listens on LISTEN_HOST (a free port), prints `FORWARDING <port>` once it does, and copies bytes both
ways between each connection and TARGET. It lets the node namespaces reach the machine's Redis,
which listens on 127.0.0.1 only: they connect to the test LAN's host address, never to anything
outside the namespaces the test made. It exits when its standard input closes (its test ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):  # either side went away: both directions end
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.close()


async def main(listen: str, target: str) -> None:
    host, port = target.rsplit(":", 1)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(accept, listen, 0)
    print(f"FORWARDING {server.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.buffer.read)
    async with server:
        await stdin_closed
    server.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(sys.argv[1], sys.argv[2]))
