"""sglang's own test hooks as fault sources: which hook a target has (read from its source), a hook fault's
activation (the variable set where sglang's real ``envs`` reads it, the fired marker written on sglang's
log line, both undone), and a switch turning a hook on and off through sglang's real ``EnvField`` reads."""

from __future__ import annotations

import logging
import os

import pytest

from harness import faults
from harness.engines.server import env_switch
from harness.faults import source
from harness.targets.sglang.compat import testhooks


def _tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / "sglang" / "srt" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_installed_sglang_has_the_transfer_failure_and_retraction_hooks_and_no_metadata_one():
    assert testhooks.hook_of("transfer-failure").env == "SGLANG_TEST_DISAGG_FAILURE_PROB"
    assert testhooks.hook_of("forced-retraction").env == "SGLANG_TEST_RETRACT"
    assert testhooks.hook_missing("metadata-corruption").startswith("this sglang has no metadata-corruption")


def test_a_release_spells_the_kv_corruption_hook_its_own_way(tmp_path):
    newer = _tree(tmp_path / "main", {"disaggregation/checksum.py": "envs.SGLANG_TEST_DISAGG_KV_CORRUPT_PROB.get()"})
    v0523 = _tree(tmp_path / "523", {"disaggregation/decode.py": "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB"})
    older = _tree(tmp_path / "522", {"disaggregation/decode.py": "no hook here"})
    assert testhooks.hook_of("landed-kv-corruption", newer).env == "SGLANG_TEST_DISAGG_KV_CORRUPT_PROB"
    assert testhooks.hook_of("landed-kv-corruption", v0523).env == "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB"
    assert "SGLANG_TEST_DISAGG_KV_CORRUPT_PROB" in testhooks.hook_missing("landed-kv-corruption", older)


def test_fired_lines_name_the_request_in_sglangs_words():
    hook = testhooks.hook_of("transfer-failure")
    said = (
        "Decode transfer failed for request rank=0 decode_req.req.rid='r-1' decode_req.req.bootstrap_room=7 "
        "with exception KVTransferError(bootstrap_room=7): Failed due to an unknown reason from another rank"
    )
    assert testhooks.fired_lines(hook, said, "r-1") == [said]
    assert testhooks.fired_lines(hook, said, "r-2") == []
    aborted = said.replace("Failed due to an unknown reason from another rank", "Aborted by AbortReq.")
    assert testhooks.fired_lines(hook, aborted, "r-1") == [], "an abort is not the hook"


@pytest.fixture
def fired_file(tmp_path, monkeypatch):
    path = tmp_path / "fired.txt"
    monkeypatch.setenv(source.FIRED_ENV, str(path))
    monkeypatch.delenv("SGLANG_TEST_RETRACT", raising=False)
    yield path
    faults.deactivate()


def test_a_hook_fault_sets_sglangs_variable_and_its_log_line_proves_it_fired(fired_file):
    from sglang.srt.environ import envs

    assert faults.activate(["sglang-hook-forced-retraction"]) == ["sglang-hook-forced-retraction"]
    assert envs.SGLANG_TEST_RETRACT.get() is True
    log = logging.getLogger("sglang.srt.managers.scheduler")
    log.warning("Testing retraction. #retracted_reqs: 0, #new_tokens_gained: 0")  # a batch of one: no retraction
    assert not fired_file.exists()
    log.warning("Testing retraction. #retracted_reqs: 1, #new_tokens_gained: 192")
    assert source.fired(fired_file) == {"sglang-hook-forced-retraction"}
    faults.deactivate(["sglang-hook-forced-retraction"])
    assert "SGLANG_TEST_RETRACT" not in os.environ and envs.SGLANG_TEST_RETRACT.get() is False
    log.warning("Testing retraction. #retracted_reqs: 1, #new_tokens_gained: 192")
    assert fired_file.read_text().splitlines() == ["sglang-hook-forced-retraction"], "the watcher outlived its fault"


def test_hook_faults_are_named_like_the_catalogs_but_not_checked_by_default():
    assert faults.parse_names("sglang-hook-transfer-failure") == ["sglang-hook-transfer-failure"]
    assert "sglang-hook-transfer-failure" not in faults.catalog()
    assert not faults.get("sglang-hook-transfer-failure").is_patch


def test_a_switch_turns_a_hook_on_for_its_side_only_through_sglangs_own_reads(tmp_path, monkeypatch):
    from sglang.srt import environ

    monkeypatch.delenv("SGLANG_TEST_DISAGG_FAILURE_PROB", raising=False)
    monkeypatch.setattr(environ.EnvField, "get", environ.EnvField.get)  # undone after the test
    led = tmp_path / "ledger"
    env_switch._install_environ(env_switch.Switches(str(led / "decode-0.jsonl"), "decode"), environ)
    var = environ.envs.SGLANG_TEST_DISAGG_FAILURE_PROB  # what sglang's poll reads, each poll
    assert var.get() == 0.0
    prefill = env_switch.Switches(str(led / "prefill-0.jsonl"), "prefill")  # another server's, same os.environ here
    prefill.sync("SGLANG_TEST_DISAGG_FAILURE_PROB")
    with env_switch.EnvSwitch(led, "SGLANG_TEST_DISAGG_FAILURE_PROB", "1", side="decode"):
        assert var.get() == 1.0
        prefill.sync("SGLANG_TEST_DISAGG_FAILURE_PROB")
        assert "SGLANG_TEST_DISAGG_FAILURE_PROB" not in os.environ, "the decode switch reached prefill"
    assert var.get() == 0.0 and "SGLANG_TEST_DISAGG_FAILURE_PROB" not in os.environ
    with pytest.raises(env_switch.SwitchError, match="not one of the switchable"):
        env_switch.EnvSwitch(led, "SGLANG_IS_IN_CI", "1")


def test_a_switch_reaches_the_schedulers_import_time_copy_of_the_retraction_hook(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_TEST_RETRACT", raising=False)
    seen: list[bool] = []

    class Scheduler:
        def update_running_batch(self, batch):
            seen.append(module.TEST_RETRACT)
            return batch

    class module:  # the scheduler module's shape: its copy, read at import, and its Scheduler
        TEST_RETRACT = False
        TEST_RETRACT_INTERVAL = 3

    from sglang.srt import environ

    module.Scheduler = Scheduler
    led = tmp_path / "ledger"
    switches = env_switch.Switches(str(led / "decode-0.jsonl"), "decode")
    monkeypatch.setattr(environ.EnvField, "get", environ.EnvField.get)  # undone after the test
    env_switch._install_environ(switches, environ)  # sglang's real EnvField, as in a server
    env_switch._install_scheduler(switches, module)
    Scheduler().update_running_batch(None)
    with env_switch.EnvSwitch(led, "SGLANG_TEST_RETRACT", "1"):
        Scheduler().update_running_batch(None)
    Scheduler().update_running_batch(None)
    assert seen == [False, True, False]


def test_a_switch_reaches_decodes_copy_of_the_waiting_timeout_at_each_poll(tmp_path, monkeypatch):
    # sglang's KV manager reads SGLANG_DISAGGREGATION_WAITING_TIMEOUT once, at its start; its receivers compare
    # against that copy at each poll. The switch sets the copy before each poll, and back when it is off.
    monkeypatch.delenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", raising=False)
    from sglang.srt import environ

    class CommonKVReceiver:  # the conn module's shape: a receiver whose poll reads its manager's copy
        def __init__(self, manager):
            self.kv_mgr = manager

        def poll(self):
            return self.kv_mgr.waiting_timeout

    class module:
        pass

    module.CommonKVReceiver = CommonKVReceiver
    led = tmp_path / "ledger"
    monkeypatch.setattr(environ.EnvField, "get", environ.EnvField.get)  # undone after the test
    env_switch._install_environ(env_switch.Switches(str(led / "decode-0.jsonl"), "decode"), environ)
    env_switch._install_receiver(module)
    default = environ.envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
    receiver = CommonKVReceiver(type("Manager", (), {"waiting_timeout": default})())
    assert receiver.poll() == default == 300
    with env_switch.EnvSwitch(led, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "2", server="decode-1"):
        assert receiver.poll() == 300, "another server's switch reached this one"
    with env_switch.EnvSwitch(led, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "2", server="decode-0"):
        assert receiver.poll() == 2
    assert receiver.poll() == 300
    with pytest.raises(env_switch.SwitchError, match="a side or a server, not both"):
        env_switch.EnvSwitch(led, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "2", side="decode", server="decode-0")
