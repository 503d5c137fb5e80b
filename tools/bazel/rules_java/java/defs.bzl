"""A local stand-in for @rules_java//java:defs.bzl as Bazel 4.2.3 uses it (no download).

jaxvt builds no Java, but Bazel 4 parses @bazel_tools//tools/jdk (a registered toolchain package)
during toolchain resolution of every build, and that package loads @rules_java//java:defs.bzl,
which the DEFAULT.WORKSPACE.SUFFIX would fetch from GitHub (commit 7cf3cefd, whose defs.bzl only
forwards to the native rules). jaxvt's WORKSPACE points @rules_java here: the same forwarding
macros, nothing else.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_lite_proto_library(**attrs):
    native.java_lite_proto_library(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
