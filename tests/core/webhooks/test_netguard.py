"""Where a webhook may be sent: checked at registration and before every attempt."""

from __future__ import annotations

import ipaddress

import pytest

from core.infra import netguard
from core.infra.netguard import UrlRefused
from core.infra.settings import Settings


def settings(**kw: object) -> Settings:
    return Settings(DATABASE_URL="sqlite://", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("url", "why"), [
    ("https://127.0.0.1/hook", "loopback"),
    ("https://[::1]/hook", "loopback"),
    ("https://localhost/hook", "loopback"),
    ("https://10.1.2.3/hook", "private"),
    ("https://192.168.0.7/hook", "private"),
    ("https://169.254.169.254/latest/meta-data", "link-local"),
    ("https://[fe80::1]/hook", "link-local"),
    ("https://224.0.0.1/hook", "multicast"),
    ("https://0.0.0.0/hook", "unspecified"),
    ("https://[::ffff:127.0.0.1]/hook", "loopback"),
    ("https://100.64.0.1/hook", "not a public address"),
])
def test_non_public_addresses_are_refused(url: str, why: str) -> None:
    with pytest.raises(UrlRefused, match=why):
        netguard.check(url, settings())


@pytest.mark.parametrize(("url", "why"), [
    ("http://93.184.215.14/hook", "https"),
    ("ftp://93.184.215.14/hook", "https"),
    ("https://user:pw@93.184.215.14/hook", "credentials"),
    ("https:///hook", "no host"),
    ("https://93.184.215.14:0/hook", "port 0"),
    ("https://93.184.215.14:99999/hook", "not a valid URL"),
    ("https://93.184.215.14/" + "a" * 2100, "longer"),
    ("https://no-such-host.invalid/hook", "does not resolve"),
    ("https://93.184.215.14/a\x00b", "control characters"),
    ("https://93.184.215.14/a b", "spaces"),
])
def test_malformed_or_insecure_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(UrlRefused, match=why):
        netguard.check(url, settings())


def test_a_public_address_is_accepted_and_connected_to_as_checked() -> None:
    target = netguard.check("https://93.184.215.14:8443/hooks?x=1", settings())
    assert target.address == ipaddress.ip_address("93.184.215.14")
    assert target.connect_url == "https://93.184.215.14:8443/hooks?x=1"
    assert target.host_header == "93.184.215.14:8443"


def test_a_name_is_called_at_the_address_it_resolved_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netguard, "resolve", lambda host, port: [
        ipaddress.ip_address("2606:4700::1111")])
    target = netguard.check("https://hooks.example.com/in", settings())
    assert target.connect_url == "https://[2606:4700::1111]:443/in"
    assert target.host_header == "hooks.example.com"


def test_one_private_address_among_public_ones_refuses_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netguard, "resolve", lambda host, port: [
        ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address("10.0.0.5")])
    with pytest.raises(UrlRefused, match="hooks.example.com resolves to 10.0.0.5"):
        netguard.check("https://hooks.example.com/in", settings())


def test_the_operator_allows_networks_and_http() -> None:
    allowed = settings(webhook_allowed_networks="127.0.0.1/32,10.0.0.0/8",
                       webhook_allow_http=True)
    assert netguard.check("http://127.0.0.1:8080/x", allowed).port == 8080
    assert netguard.check("https://10.9.9.9/x", allowed).port == 443
    with pytest.raises(UrlRefused, match="private"):
        netguard.check("https://192.168.1.1/x", allowed)


def test_a_bad_network_setting_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="WEBHOOK_ALLOWED_NETWORKS"):
        settings(webhook_allowed_networks="10.0.0.0/33")
