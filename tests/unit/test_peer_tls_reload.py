"""The agent loads a renewed peer certificate without restarting: the operator writes a new key and
certificate into the same Secret, the kubelet swaps the mounted files (an atomic ``..data``
symlink), and ``PeerTls.reload_if_changed`` loads them into the contexts the peer door and the
peer client already use. Real TLS 1.3 handshakes on loopback show which certificate is presented;
a connection opened before the swap carries on; a half-written set is not taken."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

from pdfabric_agent.protocol import tls
from pdfabric_operator import pki

NS, CLUSTER = "ns", "pd"


def kubelet_write(volume: Path, files: dict[str, bytes], generation: int) -> None:
    """What the kubelet does for a Secret volume: a new timestamped directory, then one rename of
    the ``..data`` symlink, the visible names being symlinks through it."""
    target = volume / f"..gen{generation}"
    target.mkdir()
    for name, data in files.items():
        (target / name).write_bytes(data)
    tmp = volume / "..data_tmp"
    os.symlink(target.name, tmp)
    os.replace(tmp, volume / "..data")
    for name in files:
        if not (volume / name).is_symlink():
            os.symlink(f"..data/{name}", volume / name)


def leaf_files(ca: pki.KeyPair, agent: str) -> dict[str, bytes]:
    leaf = pki.issue_agent(ca, namespace=NS, cluster=CLUSTER, agent=agent, dns_name=f"{agent}.local")
    return {tls.CERT_FILE: leaf.cert_pem, tls.KEY_FILE: leaf.key_pem, tls.CA_FILE: ca.cert_pem}


async def presented_serial(port: int, client: ssl.SSLContext) -> int:
    """The serial of the certificate the server presents to a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="a1.local")
    cert = writer.get_extra_info("peercert")
    writer.write(b"x")
    await writer.drain()
    assert await reader.readexactly(1) == b"x"
    writer.close()
    await writer.wait_closed()
    return int(cert["serialNumber"], 16)


def test_a_renewed_certificate_is_presented_to_new_connections_without_a_restart(tmp_path: Path) -> None:
    ca = pki.new_ca(NS, CLUSTER, "uid-1")
    server_dir, client_dir = tmp_path / "a1", tmp_path / "a2"
    server_dir.mkdir()
    client_dir.mkdir()
    first = leaf_files(ca, "a1")
    kubelet_write(server_dir, first, 1)
    kubelet_write(client_dir, leaf_files(ca, "a2"), 1)
    peer_tls = tls.PeerTls(str(server_dir))
    assert tls.PeerTls.of(str(server_dir)) is not peer_tls and tls.PeerTls.of(str(server_dir)) is tls.PeerTls.of(
        str(server_dir)
    )
    client = tls.client_context(str(client_dir))

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=peer_tls.server)
        port = server.sockets[0].getsockname()[1]
        serial_of = {pki.serial_hex(first[tls.CERT_FILE])}
        assert format(await presented_serial(port, client), "x") in serial_of
        assert peer_tls.reload_if_changed() is None  # nothing changed: nothing loaded

        # A connection opened before the renewal.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="a1.local")

        renewed = leaf_files(ca, "a1")
        kubelet_write(server_dir, renewed, 2)
        assert peer_tls.reload_if_changed() == "loaded" and peer_tls.reloads == 1
        assert format(await presented_serial(port, client), "x") == pki.serial_hex(renewed[tls.CERT_FILE])
        writer.write(b"y")  # the old connection carries on
        await writer.drain()
        assert await reader.readexactly(1) == b"y"
        writer.close()

        # A set whose key is not its certificate's (halfway through an update) is not taken.
        broken = leaf_files(ca, "a1")
        broken[tls.KEY_FILE] = leaf_files(ca, "a1")[tls.KEY_FILE]
        kubelet_write(server_dir, broken, 3)
        assert peer_tls.reload_if_changed() == "refused"
        assert format(await presented_serial(port, client), "x") == pki.serial_hex(renewed[tls.CERT_FILE])
        fixed = leaf_files(ca, "a1")
        kubelet_write(server_dir, fixed, 4)
        assert peer_tls.reload_if_changed() == "loaded"  # tried again on the next check
        assert format(await presented_serial(port, client), "x") == pki.serial_hex(fixed[tls.CERT_FILE])
        server.close()
        await server.wait_closed()

    asyncio.run(go())


def test_the_client_side_presents_the_renewed_certificate_too(tmp_path: Path) -> None:
    ca = pki.new_ca(NS, CLUSTER, "uid-1")
    server_dir, client_dir = tmp_path / "a1", tmp_path / "a2"
    server_dir.mkdir()
    client_dir.mkdir()
    kubelet_write(server_dir, leaf_files(ca, "a1"), 1)
    kubelet_write(client_dir, leaf_files(ca, "a2"), 1)
    server_ctx = tls.server_context(str(server_dir))
    client_tls = tls.PeerTls(str(client_dir))
    seen: list[int] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(int(writer.get_extra_info("peercert")["serialNumber"], 16))
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(record, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]

        async def connect() -> None:
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_tls.client, server_hostname="a1.local"
            )
            await asyncio.sleep(0.05)
            writer.close()

        await connect()
        renewed = leaf_files(ca, "a2")
        kubelet_write(client_dir, renewed, 2)
        assert client_tls.reload_if_changed() == "loaded"
        await connect()
        server.close()
        await server.wait_closed()
        assert format(seen[-1], "x") == pki.serial_hex(renewed[tls.CERT_FILE]) and seen[0] != seen[-1]

    asyncio.run(go())
