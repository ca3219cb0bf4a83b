"""conftest.kvbench_forked's interpreter stays for the session, so a command needs no Popen once it
runs: a test not marked e2e must still fail naming the marker, as a Popen of an interpreter does."""

import pytest
from conftest import kvbench_forked


def test_a_unit_test_cannot_run_kvbench_through_the_forking_interpreter(tmp_path):
    with pytest.raises(AssertionError, match=r"starts kvbench \(conftest.kvbench_forked\): mark the test "
                                             r"@pytest.mark.e2e"):
        kvbench_forked([(["--help"], tmp_path)])
