/* The round trip of a cache line between two threads pinned to the first two CPUs this process may use: prints
   the median of ROUNDS rounds of TRIPS trips, in ns. Built and run by benchmarks/placement.py. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROUNDS 5
#define TRIPS 20000

static _Atomic long flag __attribute__((aligned(64)));
static int cpus[2];

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *partner(void *unused) {
    (void)unused;
    pin(cpus[1]);
    for (long i = 0; i < (long)ROUNDS * TRIPS; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {
        }
        atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 2;
    int found = 0;
    for (int c = 0; c < CPU_SETSIZE && found < 2; c++)
        if (CPU_ISSET(c, &allowed)) cpus[found++] = c;
    if (found < 2) return 3;
    pin(cpus[0]);
    pthread_t thread;
    if (pthread_create(&thread, NULL, partner, NULL) != 0) return 4;
    double rounds[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        struct timespec start, end;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (long i = (long)r * TRIPS; i < (long)(r + 1) * TRIPS; i++) {
            atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
            while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &end);
        rounds[r] = ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / TRIPS;
    }
    pthread_join(thread, NULL);
    qsort(rounds, ROUNDS, sizeof rounds[0], by_value);
    printf("%.1f\n", rounds[ROUNDS / 2]);
    return 0;
}
