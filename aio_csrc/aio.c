/* infinity C core: see aio.h. Bytes and error codes only. */
#define _GNU_SOURCE
#include "aio.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

const char *inf_backend(void) { return "linux-native-aio"; }

long inf_io_setup(unsigned nr_events, aio_context_t *ctx) {
    *ctx = 0;
    return syscall(__NR_io_setup, nr_events, ctx) < 0 ? -errno : 0;
}

long inf_io_destroy(aio_context_t ctx) {
    return syscall(__NR_io_destroy, ctx) < 0 ? -errno : 0;
}

void inf_prep_rw(struct iocb *cb, int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset,
                 uint64_t user_data) {
    memset(cb, 0, sizeof(*cb));
    cb->aio_lio_opcode = is_write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_fildes = (uint32_t)fd;
    cb->aio_buf = (uint64_t)(uintptr_t)buf;
    cb->aio_nbytes = nbytes;
    cb->aio_offset = offset;
    cb->aio_data = user_data;
}

long inf_io_submit(aio_context_t ctx, long nr, struct iocb **cbs) {
    long r = syscall(__NR_io_submit, ctx, nr, cbs);
    return r < 0 ? -errno : r;
}

long inf_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events,
                      int64_t timeout_ns) {
    struct timespec ts;
    struct timespec *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000LL;
        ts.tv_nsec = timeout_ns % 1000000000LL;
        tsp = &ts;
    }
    for (;;) {
        long r = syscall(__NR_io_getevents, ctx, min_nr, nr, events, tsp);
        if (r >= 0) return r;
        if (errno != EINTR) return -errno;
    }
}

static void status_init(inf_status *st) {
    st->bytes_done = 0;
    st->fail_offset = -1;
    st->fail_length = 0;
    st->fail_result = 0;
    st->error_errno = 0;
    st->error_kind = INF_OK;
}

/* Keeps the failure with the lowest file offset, so reports do not depend on completion order. */
static void status_fail(inf_status *st, int kind, int64_t offset, int64_t length, int64_t result) {
    if (st->error_kind != INF_OK && st->fail_offset >= 0 && offset >= st->fail_offset) return;
    st->error_kind = kind;
    st->fail_offset = offset;
    st->fail_length = length;
    st->fail_result = result;
    st->error_errno = result < 0 ? (int32_t)-result : 0;
}

/* Scratch for one loop: the iocbs, the pointer batch handed to io_submit, the reaped events,
 * a stack of free iocb slots and which slots the kernel holds. One allocation, freed before the loop
 * returns (the kernel copies an iocb at io_submit and writes events only inside io_getevents). */
typedef struct ring {
    struct iocb *cbs;
    struct iocb **batch;
    struct io_event *events;
    int *free_slots;
    unsigned char *busy;
    int num_free;
} ring;

static int ring_alloc(ring *r, int depth) {
    size_t bytes = (size_t)depth * (sizeof(struct iocb) + sizeof(struct iocb *) +
                                    sizeof(struct io_event) + sizeof(int) + 1);
    char *mem = malloc(bytes);
    if (!mem) return -ENOMEM;
    r->cbs = (struct iocb *)mem;
    r->events = (struct io_event *)(r->cbs + depth);
    r->batch = (struct iocb **)(r->events + depth);
    r->free_slots = (int *)(r->batch + depth);
    r->busy = (unsigned char *)(r->free_slots + depth);
    for (int i = 0; i < depth; i++) r->free_slots[i] = depth - 1 - i;
    memset(r->busy, 0, (size_t)depth);
    r->num_free = depth;
    return 0;
}

int inf_rw_direct(aio_context_t ctx, int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset,
                  uint64_t block_size, int queue_depth, int single_submit, int overlap_events,
                  uint64_t buffer_wrap, int64_t timeout_ns, inf_status *st) {
    status_init(st);
    if (queue_depth < 1 || block_size == 0 || offset < 0 || (buffer_wrap && buffer_wrap % block_size) ||
        (buffer_wrap && buffer_wrap / block_size < (uint64_t)queue_depth)) {
        status_fail(st, INF_ERR_ARGUMENT, offset, (int64_t)nbytes, -EINVAL);
        return INF_ERR_ARGUMENT;
    }
    if (nbytes == 0) return INF_OK;

    ring r;
    long rc = ring_alloc(&r, queue_depth);
    if (rc < 0) {
        status_fail(st, INF_ERR_SETUP, offset, (int64_t)nbytes, rc);
        return INF_ERR_SETUP;
    }

    char *base = (char *)buf;
    const uint64_t num_blocks = (nbytes + block_size - 1) / block_size;
    uint64_t next_block = 0;
    long in_flight = 0;
    int stopping = 0; /* set on the first failure: submit nothing more, drain what is in flight */

    for (;;) {
        /* Fill: with overlap_events whenever a slot is free, otherwise only once the batch drained. */
        if (!stopping && next_block < num_blocks && (overlap_events || in_flight == 0)) {
            long num_ready = 0;
            while (r.num_free > 0 && next_block < num_blocks) {
                int slot = r.free_slots[--r.num_free];
                uint64_t rel = next_block * block_size;
                uint64_t len = nbytes - rel < block_size ? nbytes - rel : block_size;
                char *mem = base + (buffer_wrap ? rel % buffer_wrap : rel);
                inf_prep_rw(&r.cbs[slot], fd, is_write, mem, len, offset + (int64_t)rel,
                            (uint64_t)slot);
                r.batch[num_ready++] = &r.cbs[slot];
                next_block++;
            }
            long submitted = 0;
            while (submitted < num_ready) {
                long want = single_submit ? 1 : num_ready - submitted;
                long got = inf_io_submit(ctx, want, r.batch + submitted);
                if (got > 0) {
                    for (long i = submitted; i < submitted + got; i++) r.busy[r.batch[i]->aio_data] = 1;
                    submitted += got;
                    in_flight += got;
                    continue;
                }
                /* EAGAIN (or 0) with requests in flight: reap first, resubmit the rest later. */
                if ((got == -EAGAIN || got == 0) && in_flight > 0) break;
                struct iocb *cb = r.batch[submitted];
                status_fail(st, INF_ERR_SUBMIT, (int64_t)cb->aio_offset, (int64_t)cb->aio_nbytes,
                            got == 0 ? -EAGAIN : got);
                stopping = 1;
                break;
            }
            /* Give back the slots of what was prepared but not submitted; they go again later. */
            for (long i = num_ready - 1; i >= submitted; i--) {
                r.free_slots[r.num_free++] = (int)r.batch[i]->aio_data;
                next_block--;
            }
        }
        if (in_flight == 0) {
            if (stopping || next_block >= num_blocks) break;
            continue;
        }

        /* overlap_events: reap one completion and refill its slot at once (fio's default). Reaping
         * several and resubmitting them in one io_submit lets the block layer plug and merge the
         * contiguous batch into one large request; they then complete together and the queue runs
         * dry between batches (measured: ~10% lower throughput on a virtio disk).
         * Otherwise: wait for the whole batch. */
        long min_nr = overlap_events ? 1 : in_flight;
        long max_nr = overlap_events ? 1 : queue_depth;
        long got = inf_io_getevents(ctx, min_nr, max_nr, r.events, timeout_ns);
        if (got == 0 && timeout_ns >= 0) {
            /* Nothing completed in time (fewer than min_nr is progress: the loop waits again). Do not
             * drain: the device may never answer. Report the oldest request in flight, which is the
             * one with the lowest offset, since blocks are submitted in file order. */
            int oldest = -1;
            for (int slot = 0; slot < queue_depth; slot++)
                if (r.busy[slot] && (oldest < 0 || r.cbs[slot].aio_offset < r.cbs[oldest].aio_offset))
                    oldest = slot;
            st->error_kind = INF_ERR_TIMEOUT;
            st->error_errno = ETIMEDOUT;
            st->fail_offset = oldest >= 0 ? (int64_t)r.cbs[oldest].aio_offset : offset;
            st->fail_length = oldest >= 0 ? (int64_t)r.cbs[oldest].aio_nbytes : (int64_t)nbytes;
            st->fail_result = -ETIMEDOUT;
            free(r.cbs);
            return INF_ERR_TIMEOUT;
        }
        if (got < 0) {
            /* The kernel still owns in-flight requests; the caller must destroy this context
             * (io_destroy waits for them) before reusing the buffer. */
            status_fail(st, INF_ERR_REAP, offset, (int64_t)nbytes, got);
            st->error_kind = INF_ERR_REAP;
            free(r.cbs);
            return INF_ERR_REAP;
        }
        for (long i = 0; i < got; i++) {
            int slot = (int)r.events[i].data;
            struct iocb *cb = &r.cbs[slot];
            int64_t res = r.events[i].res;
            if (res < 0) {
                status_fail(st, INF_ERR_IO, (int64_t)cb->aio_offset, (int64_t)cb->aio_nbytes, res);
                stopping = 1;
            } else if ((uint64_t)res != cb->aio_nbytes) {
                status_fail(st, INF_ERR_SHORT, (int64_t)cb->aio_offset, (int64_t)cb->aio_nbytes, res);
                stopping = 1;
            } else {
                st->bytes_done += res;
            }
            r.busy[slot] = 0;
            r.free_slots[r.num_free++] = slot;
            in_flight--;
        }
    }
    free(r.cbs);
    return st->error_kind;
}

int inf_rw_buffered(int fd, int is_write, void *buf, uint64_t nbytes, int64_t offset, inf_status *st) {
    status_init(st);
    if (offset < 0) {
        status_fail(st, INF_ERR_ARGUMENT, offset, (int64_t)nbytes, -EINVAL);
        return INF_ERR_ARGUMENT;
    }
    char *base = (char *)buf;
    uint64_t done = 0;
    while (done < nbytes) {
        ssize_t got = is_write ? pwrite(fd, base + done, nbytes - done, offset + (int64_t)done)
                               : pread(fd, base + done, nbytes - done, offset + (int64_t)done);
        if (got < 0) {
            if (errno == EINTR) continue;
            status_fail(st, INF_ERR_IO, offset + (int64_t)done, (int64_t)(nbytes - done), -errno);
            return INF_ERR_IO;
        }
        if (got == 0) {
            status_fail(st, INF_ERR_SHORT, offset + (int64_t)done, (int64_t)(nbytes - done), 0);
            return INF_ERR_SHORT;
        }
        done += (uint64_t)got;
        st->bytes_done = (int64_t)done;
    }
    return INF_OK;
}
