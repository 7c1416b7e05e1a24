"""Taking the spent bootstrap token out of a config file (plexd.config_edit.remove_token_value): the rest of the
file stays as the operator wrote it, and a file it cannot edit safely is left unchanged with a clear error."""

from __future__ import annotations

import os

import pytest

from plexd import config
from plexd.config_edit import remove_token_value
from plexd.errors import ConfigError


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


def test_a_file_it_cannot_edit_safely_is_left_unchanged(tmp_path):
    path = tmp_path / "config.yaml"
    text = 'api: https://cp\n"token": {"value": "tok-1"}\n'
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"token\.value is not written as a 'value:' line under 'token:'"):
        remove_token_value(str(path))
    assert path.read_text() == text
