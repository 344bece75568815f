"""cffi builder for the C core (API mode): the cdef and set_source, nothing else.

setuptools runs this through ``cffi_modules`` and compiles ``infinity._aio``. Only a C compiler
and the kernel headers are needed; no libaio.
"""

from cffi import FFI

CDEF = """
typedef int... aio_context_t;

struct iocb { uint64_t aio_data; uint64_t aio_nbytes; int64_t aio_offset; ...; };
struct io_event { uint64_t data; uint64_t obj; int64_t res; int64_t res2; };

typedef struct inf_status {
    int64_t bytes_done;
    int64_t fail_offset;
    int64_t fail_length;
    int64_t fail_result;
    int32_t error_errno;
    int32_t error_kind;
} inf_status;

enum inf_error_kind {
    INF_OK, INF_ERR_ARGUMENT, INF_ERR_SETUP, INF_ERR_SUBMIT, INF_ERR_REAP, INF_ERR_IO, INF_ERR_SHORT,
    INF_ERR_TIMEOUT
};

long inf_io_setup(unsigned nr_events, aio_context_t *ctx);
long inf_io_destroy(aio_context_t ctx);
void inf_prep_rw(struct iocb *cb, int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset,
                 uint64_t user_data);
long inf_io_submit(aio_context_t ctx, long nr, struct iocb **cbs);
long inf_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events,
                      int64_t timeout_ns);
int inf_rw_direct(aio_context_t ctx, int fd, int is_write, void *buf, uint64_t nbytes,
                  int64_t offset, uint64_t block_size, int queue_depth, int single_submit,
                  int overlap_events, uint64_t buffer_wrap, int64_t timeout_ns, inf_status *st);
int inf_rw_buffered(int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset,
                    inf_status *st);
const char *inf_backend(void);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "infinity._aio",
    '#include "aio.h"',
    # Paths relative to the project root: setuptools runs builds from there and rejects absolute ones.
    sources=["aio_csrc/aio.c"],
    include_dirs=["aio_csrc"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
