"""A local `kvmesh serve` turns Ray token auth on unless the user chose (cluster/ray_token.py)."""

from __future__ import annotations

import stat

from kvmesh.cluster.ray_token import enable_token_auth


def test_token_auth_is_turned_on_with_a_new_token_only_its_owner_can_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    environ = {}
    assert enable_token_auth(environ) is None
    assert environ == {"RAY_AUTH_MODE": "token"}
    token = tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text()) == 64
    first = token.read_text()
    assert enable_token_auth({}) is None and token.read_text() == first  # kept, not replaced


def test_a_mode_or_token_the_user_set_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    environ = {"RAY_AUTH_MODE": "disabled"}
    enable_token_auth(environ)
    assert environ == {"RAY_AUTH_MODE": "disabled"}
    for chosen in ({"RAY_AUTH_TOKEN_PATH": "/somewhere/token"}, {"RAY_AUTH_TOKEN": "t" * 64}):
        environ = dict(chosen)
        enable_token_auth(environ)
        assert environ == {**chosen, "RAY_AUTH_MODE": "token"}
        assert not (tmp_path / ".ray").exists()


def test_a_token_file_other_users_can_read_is_named_in_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("x" * 64)
    token.chmod(0o644)
    warning = enable_token_auth({})
    assert warning is not None and str(token) in warning and "chmod 600" in warning
