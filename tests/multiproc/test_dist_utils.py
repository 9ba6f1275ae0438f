import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def test_gloo_all_reduce_two_ranks():
    run_distributed(_allreduce, 2)


def _rank1_killed(rank, world_size):
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback reaches the queue
    dist.all_reduce(torch.ones(1))  # rank 0: its peer is gone


def test_a_rank_killed_by_a_signal_is_named_beside_its_peers_error():
    import pytest

    with pytest.raises(AssertionError) as err:
        run_distributed(_rank1_killed, 2, timeout=120)
    assert "rank 1: killed by SIGKILL" in str(err.value)


def _says_where_it_runs(rank, world_size):
    import os
    import sys

    print(f"rank {rank} in {os.getcwd()} with MESHPPO_TEST_MARK={os.environ.get('MESHPPO_TEST_MARK')}",
          file=sys.stderr, flush=True)


def test_ranks_get_the_tests_environment_directory_and_output(tmp_path, monkeypatch, capfd):
    """Ranks are forked from a server started earlier (with torch imported): still they see what a
    rank spawned now would, this test's environment and working directory, and write into its
    captured stderr. Twice, so that the second test runs on a server started before it."""
    for mark in ("first", "second"):
        monkeypatch.setenv("MESHPPO_TEST_MARK", mark)
        monkeypatch.chdir(tmp_path)
        run_distributed(_says_where_it_runs, 2)
        err = capfd.readouterr().err
        for rank in (0, 1):
            assert f"rank {rank} in {tmp_path} with MESHPPO_TEST_MARK={mark}" in err, err


def _what_is_imported(rank, world_size, interpreting):
    import os
    import sys

    # the fork server's ranks start with PRELOAD imported; an interpreting rank without it, importing triton
    # with TRITON_INTERPRET=1 set (to have the interpreter patch triton.language once a launch), and then
    # decorating its kernels as the interpreter's
    assert all(m in sys.modules for m in ("torch._dynamo", "transformers")) != interpreting
    assert os.environ.get("TRITON_INTERPRET") == ("1" if interpreting else None)
    if interpreting:
        import triton
        from triton.runtime import interpreter

        if hasattr(interpreter, "_LangPatchScope"):  # a Triton with the internals it patches
            assert interpreter._patch_lang.__module__ == "tests.interpreter"

        @triton.jit
        def kernel(x):
            pass

        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(kernel, InterpretedFunction), type(kernel)


def test_ranks_start_with_the_preload_or_afresh_to_interpret_triton(monkeypatch):
    """The fork server's ranks have PRELOAD imported (torch._dynamo, and with it triton, and transformers:
    seconds a rank); `triton_interpret=True` ranks start without them, TRITON_INTERPRET=1 set, so
    that `@triton.jit` gives the interpreter's kernels, patched to patch triton.language once a launch."""
    import pytest

    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run_distributed(_what_is_imported, 2, False)
    run_distributed(_what_is_imported, 2, True, triton_interpret=True)


def _fails_at_length(rank, world_size, length):
    if rank == 1:
        raise ValueError("x" * length + " <end of the long message>")
    dist.all_reduce(torch.ones(1))  # rank 0: its peer fails before this collective


def test_a_traceback_larger_than_a_pipe_arrives_whole():
    """A rank's traceback of 200 KB (more than a pipe holds: the rank blocks in its `put` until the test
    process reads) is read while the ranks run and reported whole, its rank named first: reading it only
    after joining the ranks waited out the timeout, then blocked on the half-read message."""
    import pytest

    with pytest.raises(AssertionError) as err:
        run_distributed(_fails_at_length, 2, 200_000, timeout=120)
    message = str(err.value)
    assert message.startswith("rank 1 failed first"), message[:300]
    assert "x" * 200_000 + " <end of the long message>" in message
