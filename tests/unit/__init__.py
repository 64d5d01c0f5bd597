"""Unit tests (fast, pure). The tree mirrors `stagectl/`: tests of `stagectl/<package>/.../<module>.py` live
in `tests/unit/<package>/.../test_<module>.py` (or `test_<topic>.py`, without the package prefix), tests of a
top-level `stagectl/<module>.py` in `tests/unit/test_<module>.py`, fuzz tests next to what they fuzz
(`test_<topic>_fuzz.py`), the benchmark harness's in `tests/unit/bench/`, whole-repository checks (import
contract, docs, examples) here. docs/development.md ("Where a unit test lives") has the full rule."""
