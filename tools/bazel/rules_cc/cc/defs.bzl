"""A local stand-in for @rules_cc//cc:defs.bzl as Bazel 4.2.3 uses it (no download).

Bazel 4's own @bazel_tools (tools/cpp/BUILD, the auto-configured @local_config_cc, ...) load the C++
rules from @rules_cc//cc:defs.bzl, and its DEFAULT.WORKSPACE.SUFFIX would fetch rules_cc from
GitHub (commit b1c40e1d, whose defs.bzl only forwards to the native rules). Debian's bazel-rules-cc
package is a newer rules_cc that Bazel 4.2.3 cannot load (it needs `use_cpp_toolchain`), so jaxvt's
WORKSPACE points @rules_cc here: the same forwarding macros, nothing else. Only
`@rules_cc//cc:defs.bzl` and `@rules_cc//cc:toolchain_type` are referenced by Bazel 4.2.3.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)
