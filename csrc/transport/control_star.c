/* The control star's thread and its notices; see control_star.h.
 *
 * Messages are 8 bytes: u32 type, i32 rank, native byte order (all ranks of
 * a job run the same build on the same kind of machine). A read may return
 * part of one; each connection buffers what it has until the 8 are there.
 *
 * Verdicts are sticky: the first one a rank records is the one it keeps, and
 * rank 0 relays the first it records to everyone, so all ranks name the
 * same culprit unless one found its own before the relay came.
 */
#define _GNU_SOURCE
#include "transport/control_star.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* BYE: leaving in good order. LOST: a rank died (EOF, reset, failed).
 * SUSPECT: "I have waited the whole timeout on this rank" (to rank 0).
 * SILENT: rank 0's verdict on a stall. */
enum { CTRL_BYE = 1, CTRL_LOST = 2, CTRL_SUSPECT = 3, CTRL_SILENT = 4 };

/* How long rank 0 collects suspicions after the first before judging. */
#define VERDICT_GRACE_MS 1000

typedef struct {
    int fd;
    int dead;               /* EOF or error seen: no longer polled */
    unsigned char buf[8];   /* a message read in parts */
    int have;
} ctrl_conn;

struct rr_star {
    int rank, size, n;
    ctrl_conn *conn;        /* rank 0: by rank; others: conn[0] is rank 0 */
    pthread_t thread;
    int bell[2];             /* to the thread: 'K' look again, 'S' stop */
    int wake_pipe[2];       /* from the thread: readable once a verdict is known */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    /* Below: under mu. */
    char *departed;         /* said goodbye, by rank */
    int verdict, silent;
    int *waits_on;          /* rank 0: whom each reporter waits on, or -1 */
    int64_t judge_at;       /* rank 0: when to judge the stall; 0: none pending */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int conn_peer(const rr_star *s, int i) { return s->rank == 0 ? i : 0; }

static void send_msg(ctrl_conn *c, uint32_t type, int32_t rank)
{
    if (c->fd < 0 || c->dead) return;
    int32_t msg[2] = {(int32_t)type, rank};
    /* 8 bytes into a nearly idle socket never block; a failure changes nothing. */
    ssize_t n = send(c->fd, msg, sizeof msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)n;
}

static void broadcast(rr_star *s, uint32_t type, int32_t rank)
{
    for (int i = 0; i < s->n; i++) send_msg(&s->conn[i], type, rank);
}

/* Under mu. Keeps the first verdict; rank 0 relays it to everyone. Returns
 * whether this one was new. */
static int record(rr_star *s, int rank, int silent)
{
    if (s->verdict >= 0) return 0;
    s->verdict = rank;
    s->silent = silent;
    if (s->rank == 0) broadcast(s, silent ? CTRL_SILENT : CTRL_LOST, rank);
    char b = 1;
    ssize_t w = write(s->wake_pipe[1], &b, 1);
    (void)w;
    pthread_cond_broadcast(&s->cond);
    return 1;
}

/* Under mu, rank 0: names the silent rank. Each reporter waits on someone;
 * following who waits on whom leads to a rank that did not report: the one
 * holding everybody up. A rank merely late into the collective reports
 * nothing either, but nobody's chain ends at it unless it is the stall. */
static void judge(rr_star *s)
{
    int size = s->size, best = -1, best_votes = 0, fallback = s->waits_on[0];
    int votes[size];
    memset(votes, 0, sizeof votes);
    for (int i = 0; i < size; i++) {
        if (s->waits_on[i] < 0) continue;
        if (fallback < 0) fallback = s->waits_on[i];
        int x = i, hops = 0;
        while (s->waits_on[x] >= 0 && hops++ <= size) x = s->waits_on[x];
        if (s->waits_on[x] < 0) votes[x]++; /* else a cycle: everyone reported */
    }
    for (int i = 0; i < size; i++)
        if (votes[i] > best_votes) { best = i; best_votes = votes[i]; }
    record(s, best >= 0 ? best : fallback >= 0 ? fallback : 0, 1);
}

/* Under mu: one whole message from connection i. */
static void handle(rr_star *s, int i, const int32_t msg[2])
{
    int peer = conn_peer(s, i), about = msg[1];
    if (about < 0 || about >= s->size) return; /* malformed: ignore */
    switch (msg[0]) {
    case CTRL_BYE:
        s->departed[about] = 1;
        /* Only rank 0 hears every goodbye: it passes each on, so a rank that
         * finds its neighbour gone can say it left rather than guess. */
        if (s->rank == 0 && about == peer) broadcast(s, CTRL_BYE, about);
        pthread_cond_broadcast(&s->cond);
        break;
    case CTRL_LOST: record(s, about, 0); break;
    case CTRL_SILENT: record(s, about, 1); break;
    case CTRL_SUSPECT:
        if (s->rank != 0) break;
        s->waits_on[peer] = about;
        if (!s->judge_at) s->judge_at = now_ms() + VERDICT_GRACE_MS;
        break;
    }
}

/* Under mu: everything readable on connection i now. */
static void drain_conn(rr_star *s, int i)
{
    ctrl_conn *c = &s->conn[i];
    for (;;) {
        ssize_t n = recv(c->fd, c->buf + c->have, sizeof c->buf - (size_t)c->have, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            c->dead = 1;
            int peer = conn_peer(s, i);
            if (!s->departed[peer]) record(s, peer, 0);
            return;
        }
        c->have += (int)n;
        if (c->have == (int)sizeof c->buf) {
            int32_t msg[2];
            memcpy(msg, c->buf, sizeof msg);
            c->have = 0;
            handle(s, i, msg);
        }
    }
}

/* Empties the doorbell; whether it said stop. */
static int rang_stop(rr_star *s)
{
    char b[16];
    ssize_t n;
    int stop = 0;
    while ((n = read(s->bell[0], b, sizeof b)) > 0)
        for (ssize_t i = 0; i < n; i++) stop |= b[i] == 'S';
    return stop;
}

static void ring_bell(rr_star *s, char what)
{
    ssize_t w = write(s->bell[1], &what, 1);
    (void)w;
}

static void *serve(void *arg)
{
    rr_star *s = arg;
    struct pollfd pfd[s->n + 1];
    for (;;) {
        pthread_mutex_lock(&s->mu);
        pfd[0] = (struct pollfd){.fd = s->bell[0], .events = POLLIN};
        for (int i = 0; i < s->n; i++)
            pfd[1 + i] = (struct pollfd){.fd = s->conn[i].dead ? -1 : s->conn[i].fd, .events = POLLIN};
        int wait = -1;
        if (s->judge_at && s->verdict < 0) {
            int64_t left = s->judge_at - now_ms();
            wait = left > 0 ? (int)left : 0;
        }
        pthread_mutex_unlock(&s->mu);
        int r = poll(pfd, (nfds_t)(s->n + 1), wait);
        if (r < 0 && errno != EINTR) break;
        if (r > 0 && pfd[0].revents && rang_stop(s)) break;
        pthread_mutex_lock(&s->mu);
        for (int i = 0; r > 0 && i < s->n; i++)
            if (pfd[1 + i].fd >= 0 && pfd[1 + i].revents) drain_conn(s, i);
        if (s->judge_at && s->verdict < 0 && now_ms() >= s->judge_at) judge(s);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

static void free_star(rr_star *s)
{
    for (int i = 0; i < 2; i++) {
        if (s->bell[i] >= 0) close(s->bell[i]);
        if (s->wake_pipe[i] >= 0) close(s->wake_pipe[i]);
    }
    for (int i = 0; i < s->n; i++)
        if (s->conn[i].fd >= 0) close(s->conn[i].fd);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cond);
    free(s->conn);
    free(s->departed);
    free(s->waits_on);
    free(s);
}

rr_star *rr_star_start(int rank, int size, const int *fds, int n, rr_error *err)
{
    rr_star *s = calloc(1, sizeof *s);
    if (!s) {
        for (int i = 0; i < n; i++) if (fds[i] >= 0) close(fds[i]);
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return NULL;
    }
    s->rank = rank;
    s->size = size;
    s->n = n;
    s->verdict = -1;
    s->bell[0] = s->bell[1] = s->wake_pipe[0] = s->wake_pipe[1] = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cond, &ca);
    pthread_condattr_destroy(&ca);
    s->conn = calloc((size_t)(n > 0 ? n : 1), sizeof *s->conn);
    s->departed = calloc((size_t)size, 1);
    s->waits_on = malloc(sizeof(int) * (size_t)size);
    if (s->conn)
        for (int i = 0; i < n; i++) s->conn[i].fd = fds[i];
    else
        for (int i = 0; i < n; i++) if (fds[i] >= 0) close(fds[i]);
    if (!s->conn || !s->departed || !s->waits_on) {
        s->n = s->conn ? n : 0;
        free_star(s);
        rr_set_error(err, RR_E_SYSTEM, -1, "out of memory");
        return NULL;
    }
    for (int i = 0; i < size; i++) s->waits_on[i] = -1;
    if (pipe2(s->bell, O_CLOEXEC | O_NONBLOCK) || pipe2(s->wake_pipe, O_CLOEXEC | O_NONBLOCK)) {
        rr_set_error(err, RR_E_SYSTEM, -1, "pipe failed: %s", strerror(errno));
        free_star(s);
        return NULL;
    }
    /* The thread takes no signals: they must interrupt the caller's waits. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&s->thread, NULL, serve, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        rr_set_error(err, RR_E_SYSTEM, -1, "cannot start the control thread: %s", strerror(rc));
        free_star(s);
        return NULL;
    }
    return s;
}

void rr_star_stop(rr_star *s, int say_bye)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    if (say_bye) broadcast(s, CTRL_BYE, s->rank);
    pthread_mutex_unlock(&s->mu);
    ring_bell(s, 'S');
    pthread_join(s->thread, NULL);
    free_star(s);
}

int rr_star_wake_fd(const rr_star *s) { return s->wake_pipe[0]; }

int rr_star_verdict(rr_star *s, int *silent)
{
    pthread_mutex_lock(&s->mu);
    int v = s->verdict;
    *silent = s->silent;
    pthread_mutex_unlock(&s->mu);
    return v;
}

int rr_star_departed(rr_star *s, int rank)
{
    pthread_mutex_lock(&s->mu);
    int d = s->departed[rank];
    pthread_mutex_unlock(&s->mu);
    return d;
}

int rr_star_wait(rr_star *s, int wait_ms, int watch, int *silent)
{
    int64_t end = now_ms() + wait_ms;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += wait_ms / 1000;
    ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&s->mu);
    while (s->verdict < 0 && !(watch >= 0 && s->departed[watch]) && now_ms() < end)
        pthread_cond_timedwait(&s->cond, &s->mu, &ts);
    int v = s->verdict;
    *silent = s->silent;
    pthread_mutex_unlock(&s->mu);
    return v;
}

int rr_star_report_lost(rr_star *s, int rank, int *silent)
{
    pthread_mutex_lock(&s->mu);
    if (record(s, rank, 0) && s->rank != 0) send_msg(&s->conn[0], CTRL_LOST, rank);
    int v = s->verdict;
    *silent = s->silent;
    pthread_mutex_unlock(&s->mu);
    return v;
}

void rr_star_suspect(rr_star *s, int waits_on)
{
    pthread_mutex_lock(&s->mu);
    if (s->rank == 0) {
        s->waits_on[0] = waits_on;
        if (!s->judge_at) s->judge_at = now_ms() + VERDICT_GRACE_MS;
        ring_bell(s, 'K'); /* the thread may sleep with no deadline */
    } else {
        send_msg(&s->conn[0], CTRL_SUSPECT, waits_on);
    }
    pthread_mutex_unlock(&s->mu);
}
