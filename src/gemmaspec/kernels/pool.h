/*
 * gemmaspec's thread pool for the CPU kernels: workers that spin briefly, then sleep; a caller that
 * never waits for a worker that has not started.
 *
 * Why not OpenMP: an OpenMP parallel region ends in a barrier that every thread of the team must
 * reach. A decode step makes ~70 small products, so each one either spin-waits for the team (and
 * collapses when another process holds a core: a spinning thread waits for one that is not running)
 * or sleeps and pays a futex wake-up per product (OMP_WAIT_POLICY=passive: about a quarter of the
 * decode time on 2 cores). Here the caller publishes a job and claims its tasks itself, one at a time,
 * from a shared counter; a worker that is awake claims tasks too; one that is asleep or descheduled
 * claims none, and the caller does its share. The caller waits only for tasks a worker has already
 * claimed. Which thread runs a task never changes its result (tasks write disjoint outputs), so the
 * results are bit-identical for any thread count and any timing.
 *
 * Workers spin (pause) for GEMMASPEC_SPIN_US microseconds after their last task (default 1000: the
 * gaps between the products of one decode step are shorter, so they stay awake through a step), then
 * sleep on a condition variable until the next job. The same scheme as llama.cpp's ggml thread pool
 * (poll, then cond-wait); written for this job shape (one counter, no barrier).
 */
#ifndef GS_POOL_H
#define GS_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define GS_POOL_MAX 64 /* most threads a job can use (the caller included) */

typedef void (*gs_task_fn)(void *ctx, int task);

static struct {
    pthread_mutex_t job;          /* held by the thread whose job the pool runs */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started;                  /* workers started (each has index 0..started-1) */
    _Atomic uint64_t state;       /* generation << 32 | next task index to claim */
    _Atomic int done;             /* tasks of the current job finished */
    _Atomic int sleeping;         /* workers waiting on cv */
    /* the current job, written by the caller before it publishes the generation */
    gs_task_fn fn;
    void *ctx;
    int ntasks, nworkers;         /* workers with index < nworkers take part */
    long spin_ns;
} gs_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, -1};

static inline void gs_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline long gs_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* The task index of a state word whose job is being written (no task may be claimed). */
#define GS_POOL_CLOSED 0xFFFFFFFFu

/* Claim and run tasks of generation gen until none is left; returns when the counter is exhausted,
 * the job is closed, or the generation moved on. The job fields are read after seeing gen and used
 * only if the claim (a compare-and-swap on the same state word) succeeds. The caller first moves the
 * state to a new, closed generation (GS_POOL_CLOSED) and only then rewrites the fields, so a claim that
 * succeeds on gen's state word proves the fields it read were gen's. (Before the closed generation,
 * a worker that read an exhausted gen's state word, then the next job's fields while the caller was
 * writing them, could claim a task of the next job under the old word: that task ran twice and its
 * extra count let the caller return while a task was still running.) */
static inline void gs_pool_work(uint32_t gen) {
    uint64_t s = atomic_load_explicit(&gs_pool.state, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(s >> 32) != gen) return;
        const uint32_t idx = (uint32_t)s;
        if (idx == GS_POOL_CLOSED) return;
        const gs_task_fn fn = gs_pool.fn;
        void *const ctx = gs_pool.ctx;
        const int ntasks = gs_pool.ntasks;
        if ((int)idx >= ntasks) return;
        if (atomic_compare_exchange_weak_explicit(&gs_pool.state, &s, s + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            fn(ctx, (int)idx);
            atomic_fetch_add_explicit(&gs_pool.done, 1, memory_order_release);
            s = atomic_load_explicit(&gs_pool.state, memory_order_acquire);
        }
    }
}

static void *gs_pool_worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(atomic_load(&gs_pool.state) >> 32);
    for (;;) {
        uint32_t gen = seen;
        const long until = gs_now_ns() + gs_pool.spin_ns;
        for (int i = 0; gen == seen; i++) {
            gen = (uint32_t)(atomic_load_explicit(&gs_pool.state, memory_order_acquire) >> 32);
            if (gen != seen) break;
            gs_cpu_relax();
            if ((i & 63) == 63) {
                if (gs_now_ns() > until) break;
                sched_yield(); /* let a runnable thread (the caller, or another process) have this core */
            }
        }
        if (gen == seen) { /* spun out: sleep until the next job */
            pthread_mutex_lock(&gs_pool.mu);
            atomic_fetch_add(&gs_pool.sleeping, 1);
            while ((gen = (uint32_t)(atomic_load(&gs_pool.state) >> 32)) == seen)
                pthread_cond_wait(&gs_pool.cv, &gs_pool.mu);
            atomic_fetch_sub(&gs_pool.sleeping, 1);
            pthread_mutex_unlock(&gs_pool.mu);
        }
        seen = gen;
        if (me < gs_pool.nworkers) gs_pool_work(gen); /* a stale nworkers only costs a failed claim */
    }
    return NULL;
}

static void gs_pool_after_fork(void) { /* a forked child has no workers, and no job in flight */
    gs_pool.started = 0;
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    gs_pool.job = fresh;
}

/* Run fn(ctx, t) for t = 0..ntasks-1 on up to nthreads threads (the caller and nthreads-1 workers),
 * each task exactly once; returns when all have finished. Tasks must write disjoint memory. The pool
 * runs one job at a time: a caller that finds it busy (another thread's product: ctypes releases the
 * GIL, so Python threads can call in together) runs its own job on its own thread instead of waiting. */
static void gs_parallel(int ntasks, int nthreads, gs_task_fn fn, void *ctx) {
    if (ntasks <= 0) return;
    if (nthreads > GS_POOL_MAX) nthreads = GS_POOL_MAX;
    if (nthreads > ntasks) nthreads = ntasks;
    if (nthreads <= 1 || pthread_mutex_trylock(&gs_pool.job) != 0) {
        for (int t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    if (gs_pool.spin_ns < 0) {
        const char *e = getenv("GEMMASPEC_SPIN_US");
        gs_pool.spin_ns = (e && *e ? atol(e) : 1000) * 1000L;
        pthread_atfork(NULL, NULL, gs_pool_after_fork);
    }
    while (gs_pool.started < nthreads - 1) { /* workers are started on first need and kept */
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, gs_pool_worker, (void *)(intptr_t)gs_pool.started) != 0) {
            pthread_attr_destroy(&at);
            break; /* no more threads: the ones there are (and the caller) do the job */
        }
        pthread_attr_destroy(&at);
        gs_pool.started++;
    }
    /* close: from here no claim on the previous job's state word can succeed, so the fields may change */
    const uint32_t closed = (uint32_t)(atomic_load(&gs_pool.state) >> 32) + 1;
    atomic_store(&gs_pool.state, ((uint64_t)closed << 32) | GS_POOL_CLOSED);
    atomic_thread_fence(memory_order_seq_cst); /* the field writes below stay after the close */
    gs_pool.fn = fn;
    gs_pool.ctx = ctx;
    gs_pool.ntasks = ntasks;
    gs_pool.nworkers = nthreads - 1;
    atomic_store_explicit(&gs_pool.done, 0, memory_order_relaxed);
    const uint32_t gen = closed + 1;
    atomic_store(&gs_pool.state, (uint64_t)gen << 32); /* open; seq_cst: ordered before the load of sleeping */
    if (atomic_load(&gs_pool.sleeping) > 0) {
        pthread_mutex_lock(&gs_pool.mu);
        pthread_cond_broadcast(&gs_pool.cv);
        pthread_mutex_unlock(&gs_pool.mu);
    }
    gs_pool_work(gen);
    /* every task is claimed; wait for those a worker is still running */
    for (int i = 0; atomic_load_explicit(&gs_pool.done, memory_order_acquire) < ntasks; i++) {
        gs_cpu_relax();
        if ((i & 255) == 255) sched_yield(); /* a worker preempted mid-task gets the core back */
    }
    pthread_mutex_unlock(&gs_pool.job);
}

#endif
