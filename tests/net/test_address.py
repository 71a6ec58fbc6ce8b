"""host:port text, address discovery and IPv6 reachability, checked with real sockets."""

import re
import socket

import pytest

from hpcrl.net import (
    ADVERTISE_HOST_ENV,
    bind_address,
    discover_host,
    family_of,
    format_hostport,
    has_ipv6,
    is_ipv6,
    parse_hostport,
)


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    # An override in the developer's shell would bypass every discovery path under test.
    monkeypatch.delenv(ADVERTISE_HOST_ENV, raising=False)


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [
        ("10.0.0.1", 8000, "10.0.0.1:8000"),
        ("node1", 8000, "node1:8000"),
        ("node-1.cluster.example", 0, "node-1.cluster.example:0"),
        ("::1", 8000, "[::1]:8000"),
        ("2001:db8:0:0:0:0:0:1", 65535, "[2001:db8:0:0:0:0:0:1]:65535"),
        ("fe80::1%eth0", 29500, "[fe80::1%eth0]:29500"),
        ("::ffff:10.0.0.1", 80, "[::ffff:10.0.0.1]:80"),
    ],
)
def test_format_and_parse_round_trip(host, port, text):
    assert format_hostport(host, port) == text
    assert parse_hostport(text) == (host, port)


def test_format_strips_existing_brackets():
    assert format_hostport("[::1]", 80) == "[::1]:80"
    assert format_hostport("[fe80::1%eth0]", 80) == "[fe80::1%eth0]:80"


@pytest.mark.parametrize("port", [-1, 65536, 8000.0, "8000", True])
def test_format_rejects_bad_port(port):
    with pytest.raises(ValueError, match=re.escape(f"0..65535, got {port!r}")):
        format_hostport("node1", port)


@pytest.mark.parametrize("host", ["", "[]", "not:ipv6"])
def test_format_rejects_bad_host(host):
    with pytest.raises(ValueError, match=re.escape(repr(host))):
        format_hostport(host, 80)


@pytest.mark.parametrize(
    "text",
    [
        "::1:8000",  # bare IPv6: the port cannot be told apart from the last group
        "fd00::2",
        "node1",
        "node1:",
        ":8000",
        "node1:http",
        "node1:+80",
        "node1:80.0",
        "node1:65536",
        "node1:-1",
        "[::1]",
        "[::1]8000",
        "[::1:8000",
        "[node1]:8000",
        "[]:8000",
        "node 1:8000",
        "",
    ],
)
def test_parse_rejects_with_the_bad_text_and_the_expected_form(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))) as error:
        parse_hostport(text)
    assert "host:port or [ipv6]:port" in str(error.value)


def test_is_ipv6_and_family_of():
    assert [is_ipv6(h) for h in ("::1", "fe80::1%eth0", "2001:db8::1")] == [True] * 3
    assert [is_ipv6(h) for h in ("[::1]", "10.0.0.1", "node1", "")] == [False] * 4
    assert [family_of(h) for h in ("::1", "10.0.0.1", "node1")] == ["ipv6", "ipv4", "ipv4"]


def test_bind_address_is_the_family_wildcard():
    assert bind_address("ipv4") == "0.0.0.0"
    assert bind_address("ipv6") == "::"
    with pytest.raises(ValueError, match="'auto'"):
        bind_address("auto")


def test_discovered_host_is_reachable_through_a_wildcard_listener():
    host = discover_host()
    assert parse_hostport(format_hostport(host, 1)) == (host, 1)
    family = family_of(host)
    _assert_reachable(bind_address(family), host, socket.AF_INET6 if family == "ipv6" else socket.AF_INET)


def test_discover_ipv4_gives_an_ipv4_address():
    host = discover_host(family="ipv4")
    assert family_of(host) == "ipv4"
    socket.inet_pton(socket.AF_INET, host)


def test_discover_ipv6_is_reachable():
    if not has_ipv6():
        pytest.skip("this machine has no IPv6: binding ::1 failed")
    host = discover_host(family="ipv6")
    assert is_ipv6(host)
    _assert_reachable("::", host, socket.AF_INET6)


def test_discover_on_loopback_interface():
    assert discover_host(interface="lo") == "127.0.0.1"
    if has_ipv6():
        assert discover_host(family="ipv6", interface="lo") == "::1"


def test_discover_rejects_unknown_interface_and_lists_real_ones():
    with pytest.raises(ValueError, match="no-such-nic0") as error:
        discover_host(interface="no-such-nic0")
    assert "lo" in str(error.value)


def test_discover_rejects_unknown_family():
    with pytest.raises(ValueError, match="'ipv5'") as error:
        discover_host(family="ipv5")
    assert "auto, ipv4, ipv6" in str(error.value)


def test_override_wins_and_loses_its_brackets(monkeypatch):
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "node7.cluster")
    assert discover_host(family="ipv6", interface="lo") == "node7.cluster"
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "[fd00::7]")
    assert discover_host() == "fd00::7"


def test_override_of_the_wrong_family_is_an_error(monkeypatch):
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "::1")
    with pytest.raises(ValueError, match=ADVERTISE_HOST_ENV) as error:
        discover_host(family="ipv4")
    assert "'::1'" in str(error.value)


def test_server_on_ipv6_loopback_is_reached_through_formatted_address():
    if not has_ipv6():
        pytest.skip("this machine has no IPv6: binding ::1 failed")
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as server:
        port = server.getsockname()[1]
        host, parsed_port = parse_hostport(format_hostport("::1", port))
        with socket.create_connection((host, parsed_port), timeout=10) as client:
            _assert_echo(server, client)


def _assert_reachable(bind_host: str, host: str, family: socket.AddressFamily) -> None:
    with socket.create_server((bind_host, 0), family=family) as server:
        port = server.getsockname()[1]
        with socket.create_connection(parse_hostport(format_hostport(host, port)), timeout=10) as client:
            _assert_echo(server, client)


def _assert_echo(server: socket.socket, client: socket.socket) -> None:
    server.settimeout(10)
    conn, _ = server.accept()
    with conn:
        client.sendall(b"ping")
        assert conn.recv(4) == b"ping"
