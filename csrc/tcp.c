/* TCP transport.
 *
 * Data: non-blocking sockets and poll(2). exchange() first tries both
 * directions without waiting and only sleeps in poll when neither can move,
 * so a full-duplex transfer keeps both directions busy from one thread.
 *
 * Failures: a peer that dies shows up as EOF or a reset on a data socket, but
 * only to its two neighbours. So every rank also keeps its rendezvous
 * connection to rank 0 (the control star) and the one who first knows the
 * culprit says so there; rank 0 relays it to everyone. A rank that sees its
 * neighbour vanish first waits briefly on the control socket, because the
 * neighbour may only have been passing on someone else's failure. A peer that
 * stays silent past the timeout is judged by rank 0: every waiting rank sends
 * it a SUSPECT; the one rank that does not is the silent one.
 *
 * Control messages are 8 bytes: u32 type, i32 rank, native byte order (all
 * ranks of a job run the same build on the same kind of machine).
 *
 * Neighbours on one host: a link may carry its data through shared memory
 * (csrc/shm_link.h) instead of the socket. The socket then only carries
 * one-byte wake-ups for a side asleep in poll, and its EOF still says the
 * peer is gone; everything else (control star, blame, timeouts) is the same.
 */
#define _GNU_SOURCE
#include "tcp.h"
#include "shm_link.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* LOST: a peer died (EOF, reset). SILENT: rank 0's verdict on a stall.
 * SUSPECT: "I have waited the whole timeout on this rank". */
enum { CTRL_BYE = 1, CTRL_LOST = 2, CTRL_SUSPECT = 3, CTRL_SILENT = 4 };

/* How long a rank that saw a neighbour vanish waits for the real culprit's
 * name, and how long rank 0 collects suspicions before its verdict. */
#define BLAME_GRACE_MS 1500
#define VERDICT_GRACE_MS 1000

typedef struct {
    rr_transport base;
    int next_fd, prev_fd;
    int *ctrl;        /* rank 0: size entries by rank; others: ctrl[0] */
    int n_ctrl;
    char *departed;   /* peers that said BYE, by rank */
    int timeout_ms;
    int spin_limit;   /* sched_yield rounds before poll  */
    int aborted;
    rr_shm_link *tx_shm, *rx_shm; /* data through shared memory, or NULL: the socket */
    int next_closed, prev_closed; /* EOF seen on a shared-memory link's socket */
} tcp_transport;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int prev_rank(const tcp_transport *t) { return (t->base.rank + t->base.size - 1) % t->base.size; }
static int next_rank(const tcp_transport *t) { return (t->base.rank + 1) % t->base.size; }
/* The rank at the other end of control descriptor i. */
static int ctrl_peer(const tcp_transport *t, int i) { return t->base.rank == 0 ? i : 0; }

static void ctrl_send(int fd, uint32_t type, int32_t rank)
{
    if (fd < 0) return;
    int32_t msg[2] = {(int32_t)type, rank};
    /* 8 bytes into an idle socket never block; a failure here changes nothing. */
    ssize_t n = send(fd, msg, sizeof msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)n;
}

static void ctrl_broadcast(tcp_transport *t, uint32_t type, int32_t rank)
{
    for (int i = 0; i < t->n_ctrl; i++) ctrl_send(t->ctrl[i], type, rank);
}

/* Reads one message from control descriptor i. Returns the type, 0 for
 * nothing or a message that needs no action, or -1 when the peer is gone
 * (*about is then that peer). */
static int ctrl_read(tcp_transport *t, int i, int *about)
{
    int32_t msg[2];
    ssize_t n = recv(t->ctrl[i], msg, sizeof msg, MSG_DONTWAIT | MSG_WAITALL);
    int peer = ctrl_peer(t, i);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (n != (ssize_t)sizeof msg) {
        close(t->ctrl[i]);
        t->ctrl[i] = -1;
        if (t->departed[peer]) return 0;
        *about = peer;
        return -1;
    }
    if (msg[1] < 0 || msg[1] >= t->base.size) return 0; /* malformed: ignore */
    *about = msg[1];
    if (msg[0] == CTRL_BYE) {
        /* Only rank 0 hears every goodbye: it passes each on, so a rank that
         * finds its neighbour gone can say it left rather than guess. */
        t->departed[msg[1]] = 1;
        if (t->base.rank == 0 && msg[1] == peer) ctrl_broadcast(t, CTRL_BYE, peer);
        return CTRL_BYE;
    }
    if (msg[0] == CTRL_SUSPECT && t->base.rank == 0) {
        *about = peer; /* rank 0 wants to know who reported */
        return CTRL_SUSPECT;
    }
    return msg[0] == CTRL_LOST || msg[0] == CTRL_SILENT ? (int)msg[0] : 0;
}

/* Polls the control sockets for up to wait_ms. Returns the lost rank named by
 * a notice (relaying it from rank 0), or -1 when none came. A SUSPECT seen by
 * rank 0 starts its verdict. A goodbye from `watch` ends the wait too. */
static int arbitrate(tcp_transport *t, int first_suspect, int own_suspect);

static int ctrl_poll(tcp_transport *t, int wait_ms, int watch, int *kind_out)
{
    int64_t end = now_ms() + wait_ms;
    struct pollfd pfd[t->n_ctrl > 0 ? t->n_ctrl : 1];
    for (;;) {
        int n = 0;
        for (int i = 0; i < t->n_ctrl; i++) {
            pfd[i].fd = t->ctrl[i];
            pfd[i].events = POLLIN;
            pfd[i].revents = 0;
            if (t->ctrl[i] >= 0) n++;
        }
        if (n == 0) return -1;
        int left = (int)(end - now_ms());
        if (left < 0) left = 0;
        int r = poll(pfd, t->n_ctrl, left);
        if (r < 0 && errno != EINTR) return -1;
        for (int i = 0; r > 0 && i < t->n_ctrl; i++) {
            if (t->ctrl[i] < 0 || !(pfd[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int about = -1, kind = ctrl_read(t, i, &about);
            if (kind == CTRL_BYE && about == watch) {
                *kind_out = CTRL_BYE;
                return about;
            }
            if (kind == CTRL_SUSPECT) {
                *kind_out = CTRL_SILENT;
                return arbitrate(t, about, -1);
            }
            if (kind == CTRL_LOST || kind == CTRL_SILENT || kind == -1) {
                *kind_out = kind == CTRL_SILENT ? CTRL_SILENT : CTRL_LOST;
                if (t->base.rank == 0) ctrl_broadcast(t, *kind_out, about);
                return about;
            }
        }
        if (now_ms() >= end) return -1;
    }
}

/* Rank 0's verdict on a stall: collect SUSPECT reports for a moment; the
 * silent rank is the one that did not report. */
static int arbitrate(tcp_transport *t, int first_suspect, int own_suspect)
{
    int size = t->base.size, reported = 0;
    char seen[size];
    memset(seen, 0, (size_t)size);
    seen[0] = 1;
    if (first_suspect >= 0) seen[first_suspect] = 1;
    int64_t end = now_ms() + VERDICT_GRACE_MS;
    struct pollfd pfd[size];
    while (now_ms() < end) {
        for (int i = 0; i < size; i++) {
            pfd[i].fd = t->ctrl[i];
            pfd[i].events = POLLIN;
            pfd[i].revents = 0;
        }
        int left = (int)(end - now_ms());
        if (poll(pfd, (nfds_t)size, left > 0 ? left : 0) <= 0) continue;
        for (int i = 1; i < size; i++) {
            if (t->ctrl[i] < 0 || !(pfd[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int about = -1, kind = ctrl_read(t, i, &about);
            if (kind == CTRL_SUSPECT) seen[about] = 1;
            if (kind == CTRL_LOST || kind == -1) { /* a harder fact beats a guess */
                ctrl_broadcast(t, CTRL_LOST, about);
                return about;
            }
            if (kind == CTRL_SILENT) return about;
        }
    }
    int verdict = -1, silent = 0;
    for (int i = 1; i < size; i++)
        if (!seen[i] && !t->departed[i]) { silent++; if (verdict < 0) verdict = i; }
    (void)reported;
    if (silent != 1) verdict = own_suspect >= 0 ? own_suspect : (verdict >= 0 ? verdict : first_suspect);
    if (verdict < 0) verdict = prev_rank(t);
    ctrl_broadcast(t, CTRL_SILENT, verdict);
    return verdict;
}

/* A neighbour vanished (EOF, reset): name whoever really failed. */
static int peer_failed(tcp_transport *t, int neighbour, const char *what, rr_error *err)
{
    int kind = CTRL_LOST;
    int culprit = t->departed[neighbour] ? neighbour : ctrl_poll(t, BLAME_GRACE_MS, neighbour, &kind);
    if (t->departed[neighbour] && culprit == neighbour) {
        /* Rank 0 may be the only one that heard the goodbye. */
        if (t->base.rank == 0) ctrl_broadcast(t, CTRL_BYE, neighbour);
        rr_set_error(err, RR_E_PEER_LOST, neighbour,
                     "lost rank %d: it has shut down (%s) while rank %d still expected data from it",
                     neighbour, what, t->base.rank);
        return err->code;
    }
    if (culprit < 0) {
        culprit = neighbour;
        if (t->base.rank == 0) ctrl_broadcast(t, CTRL_LOST, culprit);
        else ctrl_send(t->ctrl[0], CTRL_LOST, culprit);
    }
    if (culprit == neighbour && kind == CTRL_LOST)
        rr_set_error(err, RR_E_PEER_LOST, culprit, "lost rank %d: %s", culprit, what);
    else if (kind == CTRL_SILENT)
        rr_set_error(err, RR_E_PEER_LOST, culprit,
                     "lost rank %d: no progress from it for %.1f s (RINGREDUCE_TIMEOUT), reported through rank 0",
                     culprit, t->timeout_ms / 1000.0);
    else
        rr_set_error(err, RR_E_PEER_LOST, culprit,
                     "lost rank %d (reported through rank 0; rank %d saw: %s)", culprit,
                     t->base.rank, what);
    return err->code;
}

/* Nothing moved for the whole timeout. */
static int peer_silent(tcp_transport *t, int waited_on, rr_error *err)
{
    int culprit;
    if (t->base.rank == 0) {
        culprit = arbitrate(t, -1, waited_on);
    } else {
        int kind = CTRL_SILENT;
        ctrl_send(t->ctrl[0], CTRL_SUSPECT, waited_on);
        culprit = ctrl_poll(t, BLAME_GRACE_MS + VERDICT_GRACE_MS, -1, &kind);
        if (kind == CTRL_LOST && culprit >= 0) {
            rr_set_error(err, RR_E_PEER_LOST, culprit, "lost rank %d (reported through rank 0)", culprit);
            return err->code;
        }
        if (culprit < 0) culprit = 0; /* the judge itself does not answer */
    }
    rr_set_error(err, RR_E_PEER_LOST, culprit,
                 "lost rank %d: no progress for %.1f s (RINGREDUCE_TIMEOUT); rank %d was waiting on rank %d",
                 culprit, t->timeout_ms / 1000.0, t->base.rank, waited_on);
    return err->code;
}

static int would_block(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

/* Wakes the peer asleep on a shared-memory link. A full socket buffer means
 * wake-ups are already waiting for it; a dead peer shows up elsewhere. */
static void kick(int fd)
{
    char b = 0;
    ssize_t n = send(fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)n;
}

/* Reads every wake-up byte waiting on a shared-memory link's socket.
 * Returns 1 once the peer has closed it. */
static int drain(int fd)
{
    char buf[64];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) continue;
        return n == 0 || !would_block();
    }
}

static int closed_error(tcp_transport *t, int neighbour, rr_error *err)
{
    char what[96];
    snprintf(what, sizeof what, "rank %d closed its connection", neighbour);
    return peer_failed(t, neighbour, what, err);
}

/* Moves what can move now without waiting: *sent, *rcvd say how much.
 * Returns RR_OK or an error for a peer that failed. */
static int try_move(tcp_transport *t, const void *sbuf, size_t slen, size_t *sent,
                    void *rbuf, size_t rlen, size_t *rcvd, rr_error *err)
{
    if (slen && t->tx_shm) {
        *sent = rr_shm_link_write(t->tx_shm, sbuf, slen);
        if (*sent && rr_shm_link_reader_waits(t->tx_shm)) kick(t->next_fd);
        if (!*sent && !t->next_closed && drain(t->next_fd)) t->next_closed = 1;
    } else if (slen) {
        ssize_t n = send(t->next_fd, sbuf, slen, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) *sent = (size_t)n;
        else if (n < 0 && !would_block()) {
            char what[96];
            snprintf(what, sizeof what, "sending to rank %d failed: %s", next_rank(t), strerror(errno));
            return peer_failed(t, next_rank(t), what, err);
        }
    }
    if (rlen && t->rx_shm) {
        /* Bytes written before the peer left are still good: take them first.
         * An empty link looks at the socket, as recv on a TCP link would. */
        *rcvd = rr_shm_link_read(t->rx_shm, rbuf, rlen);
        if (*rcvd && rr_shm_link_writer_waits(t->rx_shm)) kick(t->prev_fd);
        if (!*rcvd && !t->prev_closed && drain(t->prev_fd)) t->prev_closed = 1;
        if (!*rcvd && t->prev_closed && !(*rcvd = rr_shm_link_read(t->rx_shm, rbuf, rlen)))
            return closed_error(t, prev_rank(t), err);
    } else if (rlen) {
        ssize_t n = recv(t->prev_fd, rbuf, rlen, MSG_DONTWAIT);
        if (n > 0) *rcvd = (size_t)n;
        else if (n == 0) return closed_error(t, prev_rank(t), err);
        else if (!would_block()) {
            char what[96];
            snprintf(what, sizeof what, "receiving from rank %d failed: %s", prev_rank(t), strerror(errno));
            return peer_failed(t, prev_rank(t), what, err);
        }
    }
    /* A reader that took every byte and then left has done its part of
     * this operation; one that left bytes behind, or gets more, has not. */
    if (t->tx_shm && t->next_closed && !*rcvd && (slen || rr_shm_link_pending(t->tx_shm)))
        return closed_error(t, next_rank(t), err);
    return RR_OK;
}

/* Raises the flags of the shared-memory sides about to sleep. Returns 0 when
 * one of them can move after all (no flag is left raised then). */
static int ready_to_sleep(tcp_transport *t, int tx, int rx)
{
    if (tx && rr_shm_link_writer_sleeps(t->tx_shm)) return 0;
    if (rx && rr_shm_link_reader_sleeps(t->rx_shm)) {
        if (tx) rr_shm_link_writer_done(t->tx_shm);
        return 0;
    }
    return 1;
}

static int tcp_exchange(rr_transport *base, const void *sbuf, size_t slen, size_t *sent,
                        void *rbuf, size_t rlen, size_t *rcvd, rr_error *err)
{
    tcp_transport *t = (tcp_transport *)base;
    *sent = *rcvd = 0;
    if (t->aborted) {
        rr_set_error(err, RR_E_PEER_LOST, -1, "transport was aborted after an earlier error");
        return err->code;
    }
    if (slen == 0 && rlen == 0) return RR_OK;
    int64_t deadline = now_ms() + t->timeout_ms;
    long long next_check = now_ms() + RR_INTERRUPT_CHECK_MS;
    int spins = 0;
    const int nfd = 2 + t->n_ctrl;
    struct pollfd pfd[nfd];
    for (;;) {
        int rc = try_move(t, sbuf, slen, sent, rbuf, rlen, rcvd, err);
        if (rc != RR_OK || *sent || *rcvd) return rc;
        /* Small messages live or die by wake-up latency. Before sleeping in
         * poll, yield the core a few times: a peer that is about to answer
         * (often on this very core, when ranks outnumber cores) runs now, and
         * we find its bytes without a sleep and a wake-up. */
        if (spins < t->spin_limit) {
            spins++;
            sched_yield();
            continue;
        }
        int tx_sleeps = slen && t->tx_shm, rx_sleeps = rlen && t->rx_shm;
        if (!ready_to_sleep(t, tx_sleeps, rx_sleeps)) continue;

        /* A shared-memory link's socket brings wake-ups (POLLIN) both ways,
         * and its EOF: watched while idle too, since writes into the mapping
         * never fail when the reader is gone. */
        int watch_next = t->tx_shm ? !t->next_closed : slen > 0;
        pfd[0] = (struct pollfd){.fd = watch_next ? t->next_fd : -1, .events = t->tx_shm ? POLLIN : POLLOUT};
        pfd[1] = (struct pollfd){.fd = rlen ? t->prev_fd : -1, .events = POLLIN};
        for (int i = 0; i < t->n_ctrl; i++)
            pfd[2 + i] = (struct pollfd){.fd = t->ctrl[i], .events = POLLIN};
        int64_t left = deadline - now_ms();
        int r = left > 0 ? poll(pfd, (nfds_t)nfd, (int)(left < RR_INTERRUPT_CHECK_MS ? left : RR_INTERRUPT_CHECK_MS)) : 0;
        int poll_errno = errno;
        if (tx_sleeps) rr_shm_link_writer_done(t->tx_shm);
        if (rx_sleeps) rr_shm_link_reader_done(t->rx_shm);
        if (rr_should_stop(base, now_ms(), &next_check, err)) {
            /* Name ourselves on the control star: the peers blame us at once. */
            if (t->base.rank == 0) ctrl_broadcast(t, CTRL_LOST, t->base.rank);
            else ctrl_send(t->ctrl[0], CTRL_LOST, t->base.rank);
            return err->code;
        }
        if (left <= 0) return peer_silent(t, rlen ? prev_rank(t) : next_rank(t), err);
        if (r < 0 && poll_errno != EINTR) {
            rr_set_error(err, RR_E_SYSTEM, -1, "poll failed: %s", strerror(poll_errno));
            return err->code;
        }
        if (r > 0 && t->tx_shm && pfd[0].fd >= 0 && pfd[0].revents && drain(t->next_fd)) t->next_closed = 1;
        if (r > 0 && t->rx_shm && pfd[1].fd >= 0 && pfd[1].revents && drain(t->prev_fd)) t->prev_closed = 1;
        for (int i = 0; r > 0 && i < t->n_ctrl; i++) {
            if (t->ctrl[i] < 0 || !(pfd[2 + i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int about = -1, kind = ctrl_read(t, i, &about), culprit = -1;
            if (kind == CTRL_SUSPECT) {
                culprit = arbitrate(t, about, -1);
                kind = CTRL_SILENT;
            } else if (kind == CTRL_LOST || kind == CTRL_SILENT || kind == -1) {
                culprit = about;
                if (t->base.rank == 0) ctrl_broadcast(t, kind == CTRL_SILENT ? CTRL_SILENT : CTRL_LOST, culprit);
            }
            if (culprit >= 0 && kind == CTRL_SILENT) {
                rr_set_error(err, RR_E_PEER_LOST, culprit,
                             "lost rank %d: no progress from it for %.1f s (RINGREDUCE_TIMEOUT), reported through rank 0",
                             culprit, t->timeout_ms / 1000.0);
                return err->code;
            }
            if (culprit >= 0) {
                rr_set_error(err, RR_E_PEER_LOST, culprit, "lost rank %d (reported through rank 0)", culprit);
                return err->code;
            }
        }
    }
}

static void tcp_abort(rr_transport *base, const rr_error *why)
{
    tcp_transport *t = (tcp_transport *)base;
    (void)why;
    if (t->aborted) return;
    t->aborted = 1;
    /* Waking the neighbours beats letting them time out; they will look on
     * the control star for the culprit's name. */
    if (t->next_fd >= 0) shutdown(t->next_fd, SHUT_RDWR);
    if (t->prev_fd >= 0) shutdown(t->prev_fd, SHUT_RDWR);
}

static void tcp_destroy(rr_transport *base)
{
    tcp_transport *t = (tcp_transport *)base;
    if (!t->aborted) ctrl_broadcast(t, CTRL_BYE, t->base.rank);
    if (t->next_fd >= 0) close(t->next_fd);
    if (t->prev_fd >= 0 && t->prev_fd != t->next_fd) close(t->prev_fd);
    for (int i = 0; i < t->n_ctrl; i++)
        if (t->ctrl[i] >= 0) close(t->ctrl[i]);
    rr_shm_link_unmap(t->tx_shm);
    rr_shm_link_unmap(t->rx_shm);
    free(t->ctrl);
    free(t->departed);
    free(t);
}

static const rr_transport_ops tcp_ops = {tcp_exchange, tcp_abort, tcp_destroy};

rr_transport *rr_tcp_create(int rank, int size, int next_fd, int prev_fd,
                            const int *ctrl_fds, int n_ctrl, double timeout_s, int spin_rounds,
                            int tx_shm_fd, int rx_shm_fd, rr_error *err)
{
    tcp_transport *t = calloc(1, sizeof *t);
    if (t) {
        t->ctrl = calloc((size_t)(n_ctrl > 0 ? n_ctrl : 1), sizeof(int));
        t->departed = calloc((size_t)size, 1);
    }
    if (!t || !t->ctrl || !t->departed) {
        if (t) { free(t->ctrl); free(t->departed); }
        free(t);
        if (tx_shm_fd >= 0) close(tx_shm_fd);
        if (rx_shm_fd >= 0) close(rx_shm_fd);
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return NULL;
    }
    t->base.ops = &tcp_ops;
    t->base.rank = rank;
    t->base.size = size;
    t->next_fd = next_fd;
    t->prev_fd = prev_fd;
    t->n_ctrl = n_ctrl;
    memcpy(t->ctrl, ctrl_fds, sizeof(int) * (size_t)n_ctrl);
    t->timeout_ms = (int)(timeout_s * 1000.0);
    if (t->timeout_ms < 1) t->timeout_ms = 1;
    t->spin_limit = spin_rounds > 0 ? spin_rounds : 0;
    int ok = 1;
    if (tx_shm_fd >= 0) ok = (t->tx_shm = rr_shm_link_map(tx_shm_fd, err)) != NULL;
    if (rx_shm_fd >= 0) {
        if (ok) ok = (t->rx_shm = rr_shm_link_map(rx_shm_fd, err)) != NULL;
        else close(rx_shm_fd);
    }
    if (!ok) {
        t->aborted = 1; /* no goodbye: the peers will see the sockets close */
        tcp_destroy(&t->base);
        return NULL;
    }
    return &t->base;
}
