"""Taking the spent bootstrap token out of a config file (plexd.config.edit.remove_token_value): the rest of the
file stays as the operator wrote it, and a file it cannot edit safely is left unchanged with a clear error."""

from __future__ import annotations

import os

import pytest

from plexd.base.errors import ConfigError
from plexd.config import settings as config
from plexd.config.edit import remove_token_value


@pytest.mark.parametrize(("before", "after"), [
    ("api: https://cp\ntoken:\n  value: tok-1  # from the admin\n  file: /t\nlog_level: debug\n",
     "api: https://cp\ntoken:\n  file: /t\nlog_level: debug\n"),
    ("api: https://cp\ntoken:\n  value: tok-1\nlog_level: debug\n", "api: https://cp\nlog_level: debug\n"),
    ("token:\n  value: >-\n    tok-1\n  env: MY_TOKEN\n", "token:\n  env: MY_TOKEN\n"),
    ("api: https://cp  # where\ntoken: {value: tok-1, file: /t}\n", "api: https://cp  # where\ntoken: {file: /t}\n"),
])
def test_the_token_value_goes_and_everything_else_stays(tmp_path, before, after):
    path = tmp_path / "config.yaml"
    path.write_text(before)
    os.chmod(path, 0o640)
    assert remove_token_value(str(path)) is True
    assert path.read_text() == after
    assert config.load(str(path), env={}).token.value == ""
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert remove_token_value(str(path)) is False  # nothing more to remove


@pytest.mark.parametrize(("text", "why"), [
    ('api: https://cp\n"token": {"value": "tok-1"}\n',
     r"token\.value is not written as a 'value:' line under 'token:'"),
    # a flow mapping over several lines: yaml.YAMLError escaped `plexd join` after the registration had
    # succeeded, and the spent token stayed
    ("api: https://cp\ntoken: {value: plx_enroll_abc,\n  file: /t}\n",
     r"cannot rewrite safely; remove token\.value by hand"),
])
def test_a_file_it_cannot_edit_safely_is_left_unchanged_with_a_clear_error(tmp_path, text, why):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        remove_token_value(str(path))
    assert path.read_text() == text


def test_join_stores_the_api_and_says_when_it_is_insecure(tmp_path):
    from plexd.config import settings as config_mod
    from plexd.config.edit import store_api_url

    path = tmp_path / "config.yaml"
    assert store_api_url(str(path), "https://cp.example.com")
    assert config_mod.load(str(path), env={}).api.url == "https://cp.example.com"
    assert not store_api_url(str(path), "https://cp.example.com")  # already so: untouched
    # a lab's plain-HTTP control plane, joined with api.allow_insecure: `plexd up` (no such env) must load it too
    assert store_api_url(str(path), "http://10.231.1.1:8080", allow_insecure=True)
    loaded = config_mod.load(str(path), env={})
    assert loaded.api.url == "http://10.231.1.1:8080" and loaded.api.allow_insecure
    assert not store_api_url(str(path), "http://10.231.1.1:8080", allow_insecure=True)
    # the long form, with a comment and another setting kept
    path.write_text("api:\n  url: https://old  # the old one\n  tls: {ca_file: /etc/ca.pem}\nlog_level: debug\n")
    assert store_api_url(str(path), "http://new:1", allow_insecure=True)
    text = path.read_text()
    assert "# the old one" in text and "ca_file: /etc/ca.pem" in text and "log_level: debug" in text
    loaded = config_mod.load(str(path), env={})
    assert (loaded.api.url, loaded.api.allow_insecure, loaded.api.tls.ca_file) == ("http://new:1", True, "/etc/ca.pem")
    # a new file for a plain-HTTP control plane
    fresh = tmp_path / "new.yaml"
    assert store_api_url(str(fresh), "http://cp:8080", allow_insecure=True)
    assert config_mod.load(str(fresh), env={}).api.allow_insecure
    # without allow_insecure, an http:// URL cannot be stored: the file would not load
    with pytest.raises(ConfigError, match=r"could not store api\.url"):
        store_api_url(str(tmp_path / "other.yaml"), "http://cp:8080")
    assert not (tmp_path / "other.yaml").exists()
