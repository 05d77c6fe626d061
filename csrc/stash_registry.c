/* stash_registry.c: the stash registry of stash_registry.h, its functions (but the two of
 * stash_budget.c) in the header's order after the private helpers.
 *
 * A chained hash table behind one pthread mutex. Buckets are chosen by the
 * anchor alone, so every record of one anchor lives in one chain; the full key is
 * compared inside the chain. Anchors are tensor data pointers, so a handful of
 * records per anchor (versions, slots) share a chain, which stays short.
 *
 * Dropping records is two-phase: the nodes are unlinked into a private list and
 * the counters updated under the lock, then the lock is released and only then
 * are the release callbacks run and the nodes freed. A callback may thus call
 * back into the registry (even keep a new entry) without deadlock. The budget (its
 * bound and demotions) and the bytes moved off the device are stash_budget.c's.
 */
#define _POSIX_C_SOURCE 200809L

#include "stash_internal.h"

#include <stdlib.h>

#define INITIAL_BUCKETS 16u /* a power of two: buckets are picked by masking */

/* Pointers are aligned and often share their high bits, so the raw value
 * masked would crowd a few buckets; a 64-bit finalizer (splitmix64's) spreads
 * every input bit over the low ones. */
static size_t bucket_of(uintptr_t anchor, size_t bucket_count) {
  uint64_t h = (uint64_t)anchor;
  h ^= h >> 30;
  h *= UINT64_C(0xbf58476d1ce4e5b9);
  h ^= h >> 27;
  h *= UINT64_C(0x94d049bb133111eb);
  h ^= h >> 31;
  return (size_t)h & (bucket_count - 1);
}

/* Sizes past rank are caller garbage and must not split one key into two. */
static int keys_equal(const stash_key *a, const stash_key *b) {
  if (a->anchor != b->anchor || a->version != b->version || a->rank != b->rank ||
      a->slot != b->slot) {
    return 0;
  }
  for (int32_t i = 0; i < a->rank; ++i) {
    if (a->shape[i] != b->shape[i]) return 0;
  }
  return 1;
}

static stash_status check_key(const stash_key *key) {
  if (key == NULL) return STASH_ERR_ARGUMENT;
  if (key->rank < 0 || key->rank > STASH_MAX_RANK) return STASH_ERR_RANK;
  return STASH_OK;
}

/* The link that points at the node holding `key` (and `id`, unless 0), or at the
 * chain's NULL end: returning the link lets callers unlink without a second walk. */
static stash_node **find_link(stash_registry *r, const stash_key *key, uint64_t id) {
  stash_node **link = &r->buckets[bucket_of(key->anchor, r->bucket_count)];
  while (*link != NULL && !(keys_equal(&(*link)->key, key) && (id == 0 || (*link)->id == id))) {
    link = &(*link)->next;
  }
  return link;
}

stash_record registry_record_of(const stash_node *node) {
  stash_record record = {&node->key, &node->entry, node->id, node->refs, node->declined, node->moved};
  return record;
}

/* Doubles the table. On allocation failure the old table stays: chaining
 * works at any load, so the caller's insertion can still go ahead. */
static void try_grow(stash_registry *r) {
  size_t new_count = r->bucket_count * 2;
  if (new_count < r->bucket_count || new_count > SIZE_MAX / sizeof(stash_node *)) return;
  stash_node **fresh = calloc(new_count, sizeof(stash_node *));
  if (fresh == NULL) return;
  for (size_t b = 0; b < r->bucket_count; ++b) {
    stash_node *node = r->buckets[b];
    while (node != NULL) {
      stash_node *next = node->next;
      size_t nb = bucket_of(node->key.anchor, new_count);
      node->next = fresh[nb];
      fresh[nb] = node;
      node = next;
    }
  }
  free(r->buckets);
  r->buckets = fresh;
  r->bucket_count = new_count;
}

/* The shared body of stash_keep and stash_decline. */
static stash_status store(stash_registry *r, const stash_key *key, stash_entry entry, int declined,
                          uint64_t *id) {
  if (r == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status;
  if (declined) entry.bytes = 0;

  demoted_payload *demoted = NULL;
  pthread_mutex_lock(&r->mutex);
  stash_stats *s = &r->stats;
  if (*find_link(r, key, 0) != NULL) {
    pthread_mutex_unlock(&r->mutex);
    return STASH_ERR_DUPLICATE; /* the caller keeps its reference: not ours to release */
  }
  stash_node *node = malloc(sizeof *node);
  if (node == NULL) {
    pthread_mutex_unlock(&r->mutex);
    return STASH_ERR_NOMEM;
  }
  stash_status room = declined ? STASH_OK : registry_make_room(r, entry.bytes, &demoted);
  if (room != STASH_OK) {
    pthread_mutex_unlock(&r->mutex);
    free(node);
    registry_release_demoted(demoted); /* the stand-ins made in vain, if any */
    return room;
  }
  node->key = *key;
  node->entry = entry;
  node->id = r->next_id++;
  node->refs = 1;
  node->declined = declined;
  node->moved = 0;
  node->read = 0;
  /* Grow past a load factor of 3/4 (records / buckets), before linking. */
  if (s->records + 1 > r->bucket_count / 4 * 3) try_grow(r);
  stash_node **head = &r->buckets[bucket_of(key->anchor, r->bucket_count)];
  node->next = *head;
  *head = node;

  s->records += 1;
  s->bytes += entry.bytes;
  if (s->bytes > s->peak_bytes) s->peak_bytes = s->bytes;
  if (declined) {
    s->declined += 1;
  } else {
    s->keeps += 1;
  }
  if (id != NULL) *id = node->id;
  pthread_mutex_unlock(&r->mutex);
  registry_release_demoted(demoted);
  return STASH_OK;
}

/* Drops one reference of the node at *link, with the lock held. With its last reference
 * the node is unlinked, uncounted and returned, to be released and freed after unlocking;
 * otherwise only its count shrinks (the registry owns one payload reference per record,
 * however many forwards share it) and NULL is returned. */
static stash_node *drop_one(stash_registry *r, stash_node **link) {
  stash_node *node = *link;
  if (!node->read) r->stats.released_unused += 1;
  if (node->refs > 1) {
    node->refs -= 1;
    return NULL;
  }
  *link = node->next;
  r->stats.records -= 1;
  registry_uncount(r, node);
  return node;
}

/* Outside the lock: releases the registry's reference of each unlinked node and frees it. */
static void release_unlinked(stash_node *unlinked) {
  while (unlinked != NULL) {
    stash_node *next = unlinked->next;
    if (unlinked->entry.release != NULL) unlinked->entry.release(unlinked->entry.payload);
    free(unlinked);
    unlinked = next;
  }
}

/* The shared body of release_if, release_anchor and clear: every matching record (of the
 * anchor `*anchor` alone, in its one chain, where anchor is not NULL), all its references. */
static stash_status release_matching(stash_registry *r, const uintptr_t *anchor, stash_predicate_fn predicate,
                                     void *context, size_t *released) {
  stash_node *unlinked = NULL;
  size_t count = 0;

  pthread_mutex_lock(&r->mutex);
  size_t first = anchor != NULL ? bucket_of(*anchor, r->bucket_count) : 0;
  size_t end = anchor != NULL ? first + 1 : r->bucket_count;
  for (size_t b = first; b < end; ++b) {
    stash_node **link = &r->buckets[b];
    while (*link != NULL) {
      stash_node *node = *link;
      stash_record record = registry_record_of(node);
      if ((anchor != NULL && node->key.anchor != *anchor) ||
          (predicate != NULL && predicate(&record, context) == 0)) {
        link = &node->next;
        continue;
      }
      *link = node->next;
      node->next = unlinked;
      unlinked = node;
      r->stats.records -= 1;
      registry_uncount(r, node);
      if (!node->read) r->stats.released_unused += node->refs;
      count += 1;
    }
  }
  pthread_mutex_unlock(&r->mutex);

  /* Outside the lock: a callback may re-enter the registry. */
  release_unlinked(unlinked);
  if (released != NULL) *released = count;
  return STASH_OK;
}

const char *stash_status_message(stash_status status) {
  switch (status) {
    case STASH_OK: return "ok";
    case STASH_ERR_ARGUMENT: return "invalid argument: a required pointer or callback is NULL";
    case STASH_ERR_RANK: return "invalid key rank: must be between 0 and STASH_MAX_RANK";
    case STASH_ERR_DUPLICATE: return "a record is already held under this key";
    case STASH_ERR_MISSING: return "no record is held under this key";
    case STASH_ERR_NOMEM: return "out of memory";
    case STASH_ERR_BUDGET: return "the entry would pass the budget (max_bytes)";
  }
  return "unknown status";
}

stash_status stash_registry_create(stash_registry **out) {
  if (out == NULL) return STASH_ERR_ARGUMENT;
  *out = NULL;
  stash_registry *r = calloc(1, sizeof *r);
  if (r == NULL) return STASH_ERR_NOMEM;
  r->bucket_count = INITIAL_BUCKETS;
  r->next_id = 1;
  r->next_slot_range = 1;
  r->stats.max_bytes = UINT64_MAX;
  r->buckets = calloc(r->bucket_count, sizeof(stash_node *));
  /* pthread_mutex_init fails only for lack of resources: report it as NOMEM. */
  if (r->buckets == NULL || pthread_mutex_init(&r->mutex, NULL) != 0) {
    free(r->buckets);
    free(r);
    return STASH_ERR_NOMEM;
  }
  *out = r;
  return STASH_OK;
}

void stash_registry_destroy(stash_registry *registry) {
  if (registry == NULL) return;
  /* A release callback may keep new records while we clear; clear again until
   * a pass drops nothing, so that nothing is left behind to leak. (A callback
   * that keeps a new entry on every release would never let this end.) */
  size_t released = 0;
  do {
    stash_clear(registry, &released);
  } while (released != 0);
  pthread_mutex_destroy(&registry->mutex);
  free(registry->buckets);
  free(registry);
}

stash_status stash_keep(stash_registry *registry, const stash_key *key, stash_entry entry, uint64_t *id) {
  return store(registry, key, entry, 0, id);
}

stash_status stash_decline(stash_registry *registry, const stash_key *key, stash_entry entry, uint64_t *id) {
  return store(registry, key, entry, 1, id);
}

stash_status stash_share(stash_registry *registry, const stash_key *key, uint64_t id) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status;
  if (id == 0) return STASH_ERR_MISSING; /* ids start at 1: no record has id 0 */

  pthread_mutex_lock(&registry->mutex);
  stash_node *node = *find_link(registry, key, id);
  if (node == NULL) {
    status = STASH_ERR_MISSING;
  } else if (node->entry.retain == NULL || node->refs == UINT32_MAX) {
    status = STASH_ERR_ARGUMENT;
  } else {
    node->refs += 1;
    if (node->declined) {
      registry->stats.declined += 1;
    } else {
      registry->stats.keeps += 1;
    }
  }
  pthread_mutex_unlock(&registry->mutex);
  return status;
}

/* stash_take (leave == 0) and stash_read (leave != 0). */
static stash_status take_or_read(stash_registry *registry, const stash_key *key, uint64_t id, stash_entry *out,
                                 uint64_t *id_out, int *declined_out, int leave) {
  if (registry == NULL || out == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status; /* a malformed key is no miss */

  pthread_mutex_lock(&registry->mutex);
  stash_node **link = find_link(registry, key, id);
  stash_node *node = *link;
  if (node == NULL) {
    registry->stats.misses += 1;
    pthread_mutex_unlock(&registry->mutex);
    return STASH_ERR_MISSING;
  }
  if (leave && node->entry.retain == NULL) {
    pthread_mutex_unlock(&registry->mutex);
    return STASH_ERR_ARGUMENT;
  }
  *out = node->entry;
  if (id_out != NULL) *id_out = node->id;
  if (declined_out != NULL) *declined_out = node->declined;
  if (!node->declined) registry->stats.replays += 1;
  if (leave) {
    node->entry.retain(node->entry.payload); /* the caller's own reference; the record's stay */
    node->read = 1;
    pthread_mutex_unlock(&registry->mutex);
    return STASH_OK;
  }
  int whole = node->refs == 1;
  if (whole) {
    *link = node->next;
    registry->stats.records -= 1;
    registry_uncount(registry, node);
  } else {
    node->refs -= 1;
    node->entry.retain(node->entry.payload); /* the caller's own reference */
  }
  pthread_mutex_unlock(&registry->mutex);

  if (whole) free(node);
  return STASH_OK;
}

stash_status stash_take(stash_registry *registry, const stash_key *key, uint64_t id, stash_entry *out,
                        uint64_t *id_out, int *declined_out) {
  return take_or_read(registry, key, id, out, id_out, declined_out, 0);
}

stash_status stash_read(stash_registry *registry, const stash_key *key, uint64_t id, stash_entry *out,
                        uint64_t *id_out, int *declined_out) {
  return take_or_read(registry, key, id, out, id_out, declined_out, 1);
}

stash_status stash_release_id(stash_registry *registry, uint64_t id) {
  if (registry == NULL) return STASH_ERR_ARGUMENT; /* id 0 is found by no record: MISSING */
  stash_node *unlinked = NULL;
  stash_status status = STASH_ERR_MISSING;

  pthread_mutex_lock(&registry->mutex);
  for (size_t b = 0; b < registry->bucket_count && status == STASH_ERR_MISSING; ++b) {
    for (stash_node **link = &registry->buckets[b]; *link != NULL; link = &(*link)->next) {
      if ((*link)->id != id) continue;
      unlinked = drop_one(registry, link);
      if (unlinked != NULL) unlinked->next = NULL;
      status = STASH_OK;
      break;
    }
  }
  pthread_mutex_unlock(&registry->mutex);

  release_unlinked(unlinked);
  return status;
}

stash_status stash_release_if(stash_registry *registry, stash_predicate_fn predicate, void *context,
                              size_t *released) {
  if (registry == NULL || predicate == NULL) return STASH_ERR_ARGUMENT;
  return release_matching(registry, NULL, predicate, context, released);
}

stash_status stash_release_anchor(stash_registry *registry, uintptr_t anchor, stash_predicate_fn predicate,
                                  void *context, size_t *released) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  return release_matching(registry, &anchor, predicate, context, released);
}

stash_status stash_clear(stash_registry *registry, size_t *released) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  return release_matching(registry, NULL, NULL, NULL, released);
}

stash_status stash_visit(stash_registry *registry, stash_visit_fn visitor, void *context) {
  if (registry == NULL || visitor == NULL) return STASH_ERR_ARGUMENT;
  pthread_mutex_lock(&registry->mutex);
  for (size_t b = 0; b < registry->bucket_count; ++b) {
    for (const stash_node *node = registry->buckets[b]; node != NULL; node = node->next) {
      stash_record record = registry_record_of(node);
      visitor(&record, context);
    }
  }
  pthread_mutex_unlock(&registry->mutex);
  return STASH_OK;
}

stash_status stash_peek(stash_registry *registry, const stash_key *key, stash_visit_fn visitor, void *context) {
  if (registry == NULL || visitor == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status;

  pthread_mutex_lock(&registry->mutex);
  const stash_node *node = *find_link(registry, key, 0);
  if (node != NULL) {
    stash_record record = registry_record_of(node);
    visitor(&record, context);
  }
  pthread_mutex_unlock(&registry->mutex);
  return node != NULL ? STASH_OK : STASH_ERR_MISSING;
}

stash_status stash_get_stats(stash_registry *registry, stash_stats *out) {
  if (registry == NULL || out == NULL) return STASH_ERR_ARGUMENT;
  pthread_mutex_lock(&registry->mutex);
  *out = registry->stats;
  pthread_mutex_unlock(&registry->mutex);
  return STASH_OK;
}

stash_status stash_reset_peak(stash_registry *registry) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  pthread_mutex_lock(&registry->mutex);
  registry->stats.peak_bytes = registry->stats.bytes;
  pthread_mutex_unlock(&registry->mutex);
  return STASH_OK;
}

stash_status stash_new_slot_range(stash_registry *registry, int64_t *first) {
  if (registry == NULL || first == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = STASH_OK;
  pthread_mutex_lock(&registry->mutex);
  if (registry->next_slot_range > INT64_MAX / STASH_SLOTS_PER_RANGE - 1) {
    status = STASH_ERR_NOMEM;
  } else {
    *first = registry->next_slot_range++ * STASH_SLOTS_PER_RANGE;
  }
  pthread_mutex_unlock(&registry->mutex);
  return status;
}
