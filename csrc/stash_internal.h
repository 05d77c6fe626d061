/* stash_internal.h: what the registry's two files share (stash_registry.c: the table and
 * the API; stash_budget.c: the budget, moved bytes, making room). Not part of the contract. */
#ifndef ATTNSTASH_STASH_INTERNAL_H
#define ATTNSTASH_STASH_INTERNAL_H

#include "stash_registry.h"

#include <pthread.h>

typedef struct stash_node {
  struct stash_node *next;
  stash_key key;
  stash_entry entry;
  uint64_t id;
  uint32_t refs;
  int declined;
  int moved; /* stash_set_moved: its bytes count in moved_bytes, not bytes */
  int read;  /* stash_read handed it out: its release is no released_unused */
} stash_node;

struct stash_registry {
  pthread_mutex_t mutex;
  stash_node **buckets;
  size_t bucket_count; /* always a power of two */
  uint64_t next_id;
  int64_t next_slot_range; /* the next range stash_new_slot_range hands out, counted from 1 */
  stash_stats stats;   /* records doubles as the table's size */
};

/* Takes a node's bytes out of the counters (bytes or moved_bytes, where it counts them). */
static inline void registry_uncount(stash_registry *r, const stash_node *node) {
  if (node->moved) {
    r->stats.moved_bytes -= node->entry.bytes;
  } else {
    r->stats.bytes -= node->entry.bytes;
  }
}

/* How a predicate or visitor sees a node. */
stash_record registry_record_of(const stash_node *node);

/* A payload the registry drops: released after the lock is released. */
typedef struct demoted_payload {
  struct demoted_payload *next;
  stash_entry entry;
} demoted_payload;

/* Makes room for `bytes` more under the budget by demoting records (stash_registry.h,
 * Budget), with the lock held. All or nothing: on failure nothing changes, and it returns
 * STASH_ERR_BUDGET (demoting cannot make room) or STASH_ERR_NOMEM. The payloads to release
 * after unlocking (those the demoted records held; on failure, the stand-ins made in vain)
 * are chained onto *to_release. */
stash_status registry_make_room(stash_registry *r, size_t bytes, demoted_payload **to_release);

/* Outside the lock: releases the registry's references to the demoted payloads. */
void registry_release_demoted(demoted_payload *demoted);

#endif /* ATTNSTASH_STASH_INTERNAL_H */
