// Preprocessor selection over the op table's columns (ops.inc): JAXVT_IF(column, ...) keeps its
// text where the column names a handler file (MAIN, GGML, PREFETCH) and drops it where it is 0;
// JAXVT_IF_GPU(...) keeps it in GPU builds. (define.h selects the ops of one handler file.)
#ifndef JAXVT_FFI_CSRC_HANDLERS_SELECT_H_
#define JAXVT_FFI_CSRC_HANDLERS_SELECT_H_

#define JAXVT_IF(column, ...) JAXVT_IF_##column(__VA_ARGS__)
#define JAXVT_IF_0(...)
#define JAXVT_IF_MAIN(...) __VA_ARGS__
#define JAXVT_IF_GGML(...) __VA_ARGS__
#define JAXVT_IF_PREFETCH(...) __VA_ARGS__

#if defined(JAXVT_WITH_GPU)
#define JAXVT_IF_GPU(...) __VA_ARGS__
#else
#define JAXVT_IF_GPU(...)
#endif

#endif  // JAXVT_FFI_CSRC_HANDLERS_SELECT_H_
