"""kernel_target reads SHARDLINE_CPU_TARGET through os.environ's store on every call:
it follows each change, as the tests' per-target fixtures make them."""

from shardline.engine.kernels import native


def test_kernel_target_follows_the_variable(monkeypatch):
    monkeypatch.delenv("SHARDLINE_CPU_TARGET", raising=False)
    assert native.kernel_target() == "native"
    for target in ("x86-64-v3", "x86-64", "x86-64-v3"):
        monkeypatch.setenv("SHARDLINE_CPU_TARGET", target)
        assert native.kernel_target() == target
    monkeypatch.setenv("SHARDLINE_CPU_TARGET", "")
    assert native.kernel_target() == "native"
    monkeypatch.delenv("SHARDLINE_CPU_TARGET")
    assert native.kernel_target() == "native"
