"""Sample suite trees for the rerun-test tests (written to tmp_path; no other engineer's suites).

``make_repo`` builds a repository root with ``suites/`` named like the README's headline files
(test_hisparse_allocator.py on cpu, test_disaggregation_basic.py on 2-gpu-h100,
test_disaggregation_dsv4.py on 8-gpu-h200) plus an ambiguous pair. The tests in them are tiny and
fast; each appends its node id to ``$RERUN_SAMPLE_LOG`` (when set) so a test can see what ran.
``make_upstream`` builds an sglang-style ``test/registered`` tree.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

_RECORD = """
import os


def _record(name):
    path = os.environ.get("RERUN_SAMPLE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(name + "\\n")
"""

FILES = {
    "suites/test_hisparse_allocator.py": """
        import pytest
        pytestmark = [pytest.mark.topology("cpu"), pytest.mark.est_time(30)]
        {record}

        def test_alloc_extend():
            _record("alloc_extend")
            assert sum([1, 2]) == 3


        class TestRelease:
            @pytest.mark.parametrize("pages", [1, 2])
            def test_release_returns_pages(self, pages):
                _record(f"release[{{pages}}]")
                assert pages > 0
        """,
    "suites/pd/test_disaggregation_basic.py": """
        import pytest
        {record}


        @pytest.mark.topology("2-gpu-h100")
        @pytest.mark.est_time(120)
        class TestDisaggregationBasic:
            def test_prealloc(self):
                _record("basic.prealloc")

            @pytest.mark.est_time(20)
            def test_transfer(self):
                _record("basic.transfer")
        """,
    "suites/pd/test_disaggregation_dsv4.py": """
        import pytest
        pytestmark = pytest.mark.topology("8-gpu-h200")
        {record}


        @pytest.mark.est_time(300)
        def test_dsv4_swa_tail():
            _record("dsv4.swa_tail")
        """,
    "suites/a/test_dup.py": """
        def test_in_a():
            pass
        """,
    "suites/b/test_dup.py": """
        def test_in_b():
            pass
        """,
}


def make_repo(root: Path, extra: dict[str, str] | None = None) -> Path:
    """Write the sample repository under ``root`` and return it."""
    for rel, body in {**FILES, **(extra or {})}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(body).format(record=_RECORD).lstrip())
    return root


UPSTREAM = {
    "registered/cpu/test_cpu_utils.py": """
        import unittest
        from sglang.test.ci.ci_register import register_cpu_ci
        register_cpu_ci(est_time=12, suite="stage-a-test-cpu")


        class TestUtils(unittest.TestCase):
            def test_one(self):
                self.assertEqual(1, 1)

            def test_two(self):
                self.assertTrue(True)


        if __name__ == "__main__":
            unittest.main()
        """,
    "registered/pd/test_pd_large.py": """
        import unittest
        from sglang.test.ci.ci_register import register_cuda_ci
        register_cuda_ci(est_time=400, stage="stage-b", runner_config="2-gpu-large")


        class TestPD(unittest.TestCase):
            def test_gsm8k(self):
                pass
        """,
    "registered/pd/test_deepep.py": """
        import unittest
        from sglang.test.ci.ci_register import register_cuda_ci
        register_cuda_ci(est_time=900, stage="stage-c", runner_config="deepep-8-gpu-h200")
        register_cuda_ci(600, "per-commit-8-gpu-h200")


        class TestDeepEP(unittest.TestCase):
            def test_mmlu(self):
                pass

            def test_gsm8k(self):
                pass
        """,
    "registered/amd/test_amd_only.py": """
        from sglang.test.ci.ci_register import register_amd_ci
        register_amd_ci(est_time=100, suite="stage-a-test-1-gpu-amd")

        def test_amd():
            pass
        """,
}


def make_upstream(root: Path, extra: dict[str, str] | None = None) -> Path:
    """Write an sglang-style ``registered/`` tree under ``root`` and return the ``registered`` dir."""
    for rel, body in {**UPSTREAM, **(extra or {})}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(body).lstrip())
    return root / "registered"
