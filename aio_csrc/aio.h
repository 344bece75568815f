/*
 * infinity C core: asynchronous reads and writes between host buffers and files.
 *
 * Mechanism only. Opening files, choosing direct or buffered I/O, alignment, staging and every
 * other policy live in Python (infinity/aio). These functions move bytes and return error codes;
 * they never abort the process and never allocate anything the caller must free, except the
 * opaque loop scratch (inf_ring_new / inf_ring_free).
 *
 * Linux native AIO is used through the kernel ABI (<linux/aio_abi.h> + syscall), so no libaio
 * package is needed to build.
 */
#ifndef INFINITY_AIO_H
#define INFINITY_AIO_H

#include <stdint.h>
#include <linux/aio_abi.h>

/* What went wrong, when a call returns nonzero. */
enum inf_error_kind {
    INF_OK = 0,
    INF_ERR_ARGUMENT = 1,  /* a length, offset or depth the loop cannot use */
    INF_ERR_SETUP = 2,     /* io_setup / allocation */
    INF_ERR_SUBMIT = 3,    /* io_submit failed */
    INF_ERR_REAP = 4,      /* io_getevents failed */
    INF_ERR_IO = 5,        /* one request completed with a negative errno */
    INF_ERR_SHORT = 6,     /* one request moved fewer bytes than asked (end of file on reads) */
    INF_ERR_TIMEOUT = 7    /* no completion within timeout_ns while requests were in flight */
};

/* The outcome of one blocked read/write loop. */
typedef struct inf_status {
    int64_t bytes_done;    /* bytes of fully completed requests */
    int64_t fail_offset;   /* file offset of the first failed request, -1 if none */
    int64_t fail_length;   /* bytes that request asked for */
    int64_t fail_result;   /* what it returned: a byte count (short) or a negative errno */
    int32_t error_errno;   /* positive errno, 0 if none (a short transfer has none) */
    int32_t error_kind;    /* enum inf_error_kind */
} inf_status;

/* ---- libaio-style primitives: thin wrappers over the syscalls; each returns >= 0 or -errno ---- */
long inf_io_setup(unsigned nr_events, aio_context_t *ctx);
long inf_io_destroy(aio_context_t ctx);
void inf_prep_rw(struct iocb *cb, int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset,
                 uint64_t user_data);
long inf_io_submit(aio_context_t ctx, long nr, struct iocb **cbs);
/* timeout_ns < 0 waits without limit; EINTR is retried. */
long inf_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events,
                      int64_t timeout_ns);

/* ---- the blocked loop ----
 * Moves nbytes between buf and fd at offset, split into block_size requests with at most
 * queue_depth in flight on ctx (which must have been set up for >= queue_depth events).
 * overlap_events: reap one completion at a time and refill its slot at once;
 * otherwise submit a batch, reap all of it, repeat.
 * single_submit: one iocb per io_submit call.
 * buffer_wrap: 0 for a buffer of nbytes; else the buffer holds buffer_wrap bytes (a multiple of
 * block_size, >= queue_depth blocks) and block i uses buf + (i * block_size) % buffer_wrap: a file
 * streamed through a ring, as fio does (benchmarks measure the disk at fio's memory footprint).
 * timeout_ns bounds each wait for a completion (< 0: no limit). If none arrives within it while
 * requests are in flight, the loop returns INF_ERR_TIMEOUT at once, without draining: st names the
 * oldest request still in flight (the lowest file offset) with errno ETIMEDOUT. Those requests still
 * own the buffer and the context: the caller must not reuse or free the buffer, and must not
 * io_destroy the context (it waits for them, forever on a dead device).
 * On any other failure it stops submitting, drains what is in flight (the buffer is the caller's) and
 * returns the error kind; st describes the first failure by file offset. */
int inf_rw_direct(aio_context_t ctx, int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset,
                  uint64_t block_size, int queue_depth, int single_submit, int overlap_events,
                  uint64_t buffer_wrap, int64_t timeout_ns, inf_status *st);

/* The same contract with plain pread/pwrite (for files that refuse O_DIRECT and for unaligned
 * tails). EINTR and partial writes are continued; a read that reaches end of file is SHORT. */
int inf_rw_buffered(int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset, inf_status *st);

/* Which mechanism this build uses (for the bindings smoke test and reports). */
const char *inf_backend(void);

#endif
