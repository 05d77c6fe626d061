/* stash_registry.c: the stash registry of stash_registry.h.
 *
 * A chained hash table behind one pthread mutex. Buckets are chosen by the
 * anchor alone, so every entry of one anchor lives in one chain and
 * stash_release_anchor visits a single bucket; the full key is compared inside
 * the chain. Anchors are tensor data pointers, so a handful of entries per
 * anchor (versions, slots) share a chain, which stays short in practice.
 *
 * Dropping entries is two-phase: matching nodes are unlinked into a private
 * list and the counters updated under the lock, then the lock is released and
 * only then are the release callbacks run and the nodes freed. A callback may
 * thus call back into the registry (even keep a new entry) without deadlock.
 */
#define _POSIX_C_SOURCE 200809L

#include "stash_registry.h"

#include <pthread.h>
#include <stdlib.h>

#define INITIAL_BUCKETS 16u /* a power of two: buckets are picked by masking */

typedef struct stash_node {
  struct stash_node *next;
  stash_key key;
  stash_entry entry;
} stash_node;

struct stash_registry {
  pthread_mutex_t mutex;
  stash_node **buckets;
  size_t bucket_count; /* always a power of two */
  stash_stats stats;   /* entries doubles as the table's size */
};

const char *stash_status_message(stash_status status) {
  switch (status) {
    case STASH_OK: return "ok";
    case STASH_ERR_ARGUMENT: return "invalid argument: a required pointer is NULL";
    case STASH_ERR_RANK: return "invalid key rank: must be between 0 and STASH_MAX_RANK";
    case STASH_ERR_DUPLICATE: return "an entry is already held under this key";
    case STASH_ERR_MISSING: return "no entry is held under this key";
    case STASH_ERR_NOMEM: return "out of memory";
  }
  return "unknown status";
}

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

/* The link that points at the node holding `key`, or at the chain's NULL end:
 * returning the link lets take unlink without a second walk. */
static stash_node **find_link(stash_registry *r, const stash_key *key) {
  stash_node **link = &r->buckets[bucket_of(key->anchor, r->bucket_count)];
  while (*link != NULL && !keys_equal(&(*link)->key, key)) link = &(*link)->next;
  return link;
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

stash_status stash_registry_create(stash_registry **out) {
  if (out == NULL) return STASH_ERR_ARGUMENT;
  *out = NULL;
  stash_registry *r = calloc(1, sizeof *r);
  if (r == NULL) return STASH_ERR_NOMEM;
  r->bucket_count = INITIAL_BUCKETS;
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

stash_status stash_keep(stash_registry *registry, const stash_key *key, stash_entry entry) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status;

  pthread_mutex_lock(&registry->mutex);
  if (*find_link(registry, key) != NULL) {
    pthread_mutex_unlock(&registry->mutex);
    return STASH_ERR_DUPLICATE; /* the caller keeps `entry`: not ours to release */
  }
  stash_node *node = malloc(sizeof *node);
  if (node == NULL) {
    pthread_mutex_unlock(&registry->mutex);
    return STASH_ERR_NOMEM;
  }
  node->key = *key;
  node->entry = entry;
  /* Grow past a load factor of 3/4 (entries / buckets), before linking. */
  if (registry->stats.entries + 1 > registry->bucket_count / 4 * 3) try_grow(registry);
  stash_node **head = &registry->buckets[bucket_of(key->anchor, registry->bucket_count)];
  node->next = *head;
  *head = node;

  stash_stats *s = &registry->stats;
  s->entries += 1;
  s->bytes += entry.bytes;
  if (s->bytes > s->peak_bytes) s->peak_bytes = s->bytes;
  s->keeps += 1;
  pthread_mutex_unlock(&registry->mutex);
  return STASH_OK;
}

stash_status stash_take(stash_registry *registry, const stash_key *key, stash_entry *out) {
  if (registry == NULL || out == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status; /* a malformed key is no miss */

  pthread_mutex_lock(&registry->mutex);
  stash_node **link = find_link(registry, key);
  stash_node *node = *link;
  if (node == NULL) {
    registry->stats.misses += 1;
    pthread_mutex_unlock(&registry->mutex);
    return STASH_ERR_MISSING;
  }
  *link = node->next;
  registry->stats.entries -= 1;
  registry->stats.bytes -= node->entry.bytes;
  registry->stats.takes += 1;
  pthread_mutex_unlock(&registry->mutex);

  *out = node->entry;
  free(node);
  return STASH_OK;
}

/* Which entries a release drops: one anchor, a caller's predicate, or all. */
typedef struct matcher {
  enum { MATCH_ANCHOR, MATCH_PREDICATE, MATCH_ALL } kind;
  uintptr_t anchor;
  stash_predicate_fn predicate;
  void *context;
} matcher;

static int matches(const matcher *m, const stash_node *node) {
  switch (m->kind) {
    case MATCH_ANCHOR: return node->key.anchor == m->anchor;
    case MATCH_PREDICATE: return m->predicate(&node->key, &node->entry, m->context) != 0;
    case MATCH_ALL: return 1;
  }
  return 0;
}

/* Moves the matching nodes of one bucket onto *dropped and uncounts them.
 * Called with the lock held. */
static size_t unlink_matching(stash_registry *r, size_t bucket, const matcher *m,
                              stash_node **dropped) {
  size_t count = 0;
  stash_node **link = &r->buckets[bucket];
  while (*link != NULL) {
    stash_node *node = *link;
    if (!matches(m, node)) {
      link = &node->next;
      continue;
    }
    *link = node->next;
    node->next = *dropped;
    *dropped = node;
    r->stats.entries -= 1;
    r->stats.bytes -= node->entry.bytes;
    r->stats.released_unused += 1;
    count += 1;
  }
  return count;
}

/* The shared body of release_anchor, release_if and clear. */
static stash_status release_matching(stash_registry *r, const matcher *m, size_t *released) {
  stash_node *dropped = NULL;
  size_t count = 0;

  pthread_mutex_lock(&r->mutex);
  if (m->kind == MATCH_ANCHOR) {
    count = unlink_matching(r, bucket_of(m->anchor, r->bucket_count), m, &dropped);
  } else {
    for (size_t b = 0; b < r->bucket_count; ++b) count += unlink_matching(r, b, m, &dropped);
  }
  pthread_mutex_unlock(&r->mutex);

  /* Outside the lock: a callback may re-enter the registry. */
  while (dropped != NULL) {
    stash_node *next = dropped->next;
    if (dropped->entry.release != NULL) dropped->entry.release(dropped->entry.payload);
    free(dropped);
    dropped = next;
  }
  if (released != NULL) *released = count;
  return STASH_OK;
}

stash_status stash_release_anchor(stash_registry *registry, uintptr_t anchor, size_t *released) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  matcher m = {MATCH_ANCHOR, anchor, NULL, NULL};
  return release_matching(registry, &m, released);
}

stash_status stash_release_if(stash_registry *registry, stash_predicate_fn predicate, void *context,
                              size_t *released) {
  if (registry == NULL || predicate == NULL) return STASH_ERR_ARGUMENT;
  matcher m = {MATCH_PREDICATE, 0, predicate, context};
  return release_matching(registry, &m, released);
}

stash_status stash_clear(stash_registry *registry, size_t *released) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  matcher m = {MATCH_ALL, 0, NULL, NULL};
  return release_matching(registry, &m, released);
}

void stash_registry_destroy(stash_registry *registry) {
  if (registry == NULL) return;
  /* A release callback may keep new entries while we clear; clear again until
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

stash_status stash_peek(stash_registry *registry, const stash_key *key, stash_visit_fn visitor, void *context) {
  if (registry == NULL || visitor == NULL) return STASH_ERR_ARGUMENT;
  stash_status status = check_key(key);
  if (status != STASH_OK) return status;

  pthread_mutex_lock(&registry->mutex);
  const stash_node *node = *find_link(registry, key);
  if (node != NULL) visitor(&node->key, &node->entry, context);
  pthread_mutex_unlock(&registry->mutex);
  return node != NULL ? STASH_OK : STASH_ERR_MISSING;
}

stash_status stash_visit(stash_registry *registry, stash_visit_fn visitor, void *context) {
  if (registry == NULL || visitor == NULL) return STASH_ERR_ARGUMENT;
  pthread_mutex_lock(&registry->mutex);
  for (size_t b = 0; b < registry->bucket_count; ++b) {
    for (const stash_node *node = registry->buckets[b]; node != NULL; node = node->next) {
      visitor(&node->key, &node->entry, context);
    }
  }
  pthread_mutex_unlock(&registry->mutex);
  return STASH_OK;
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
