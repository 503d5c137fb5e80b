#!/bin/sh
# Stand-in for Bazel's downloadable coverage tools (see BUILD.bazel).
echo "jaxvt: 'bazel coverage' is not supported by this offline Bazel setup (use pytest --cov)" >&2
exit 1
