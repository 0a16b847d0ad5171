"""Repository rules that let Debian's offline Bazel 4 (bazel-bootstrap) build the extension.

pip_paths asks the project's Python where the pip packages keep the headers (ffi/find_headers.py, the same
script CMakeLists.txt runs) and writes them to @pip_paths//:paths.bzl, which WORKSPACE loads to point
new_local_repository at those directories. Generating it in Bazel's output base keeps the source tree clean.

native_rules stands in for @rules_cc and @rules_java: @bazel_tools loads a few rules from them, and
Bazel 4 would download both from GitHub. The native rules they wrap are built into Bazel 4.
"""

# Where the pip packages not covered by ffi/find_headers.py keep what the build reads.
_MORE_PATHS = """
import os, sysconfig
try:
    import nanobind
except ImportError:
    raise SystemExit("nanobind was not found: pip install nanobind into this environment")
print("NANOBIND_DIR=" + os.path.dirname(nanobind.include_dir()))
print("PYTHON_INCLUDE_DIR=" + sysconfig.get_paths()["include"])
"""

def _run(ctx, args):
    result = ctx.execute(args)
    if result.return_code != 0:
        fail("%s failed: %s" % (" ".join([str(a) for a in args]), result.stderr))
    return result.stdout.splitlines()

def _pip_paths_impl(ctx):
    root = ctx.path(Label("//:WORKSPACE")).dirname
    python = ctx.os.environ.get("JAX_RAGGED_ATTN_PYTHON") or "%s/.venv/bin/python" % root
    if not ctx.path(python).exists:
        fail("no Python at %s: run scripts/install.sh, or pass --repo_env=JAX_RAGGED_ATTN_PYTHON=/abs/python" % python)
    lines = _run(ctx, [python, ctx.path(Label("//:ffi/find_headers.py"))])
    lines += _run(ctx, [python, "-c", _MORE_PATHS])
    paths = {}
    for line in lines:
        name, _, path = line.partition("=")
        paths[name] = path
    ctx.file("BUILD.bazel", "")
    ctx.file("paths.bzl", "PATHS = %r\n" % paths)

pip_paths = repository_rule(
    implementation = _pip_paths_impl,
    # Re-run when the Python changes or the Bazel server restarts (a pip upgrade may move the headers).
    environ = ["JAX_RAGGED_ATTN_PYTHON"],
    local = True,
)

def _native_rules_impl(ctx):
    ctx.file("WORKSPACE", "")
    ctx.file("BUILD.bazel", "")
    ctx.file(ctx.attr.package + "/BUILD.bazel", "")
    ctx.file(ctx.attr.package + "/defs.bzl", "".join([
        "def %s(**kwargs):\n    native.%s(**kwargs)\n\n" % (rule, rule)
        for rule in ctx.attr.rules
    ]))

native_rules = repository_rule(
    implementation = _native_rules_impl,
    attrs = {
        "package": attr.string(mandatory = True),
        "rules": attr.string_list(mandatory = True),
    },
)
