#!/usr/bin/env python3
"""A TCP relay in front of a server, for the tests of a server lost behind something.

Each connection it takes is relayed to the server's port. Where that port refuses, it does what
stands in front of servers does: `--mode 502` reads the request and answers 502 Bad Gateway
with an HTML page, as a reverse proxy does; `--mode drop` closes the connection without a word,
as a container runtime's published port does while the container is down.

    gateway.py --upstream-port 8000 --mode 502 --port-file gw.port
"""

import argparse
import asyncio
import os

PAGE = b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>\n"


async def read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def relay(client_reader, client_writer, upstream_port, mode):
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
    except OSError:
        try:
            if mode == "502":
                await read_request(client_reader)
                client_writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\n"
                                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(PAGE) + PAGE)
                await client_writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--mode", choices=["502", "drop"], required=True)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args()
    server = await asyncio.start_server(lambda r, w: relay(r, w, args.upstream_port, args.mode), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    temporary = args.port_file + ".tmp"
    with open(temporary, "w") as f:
        f.write(f"{port}\n")
    os.replace(temporary, args.port_file)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
