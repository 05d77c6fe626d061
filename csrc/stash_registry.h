/* stash_registry.h: the contract of attnstash's stash registry.
 *
 * A thread-safe map from a key to an opaque entry, kept from an attention
 * forward until its recompute takes it back. Plain C11: it knows nothing of
 * Python or tensors. The owner (attnstash's torch layer) stores a pointer, its
 * size in bytes and a release callback; the registry calls that callback for
 * every entry it drops without handing it back (release_anchor, release_if,
 * clear, destroy), exactly once, and never for an entry handed out by take.
 *
 * Keys: (anchor, version, shape, slot). `anchor` is the identity of the tensor
 * that ties a recompute to its first forward (its data pointer), `version` its
 * version counter, `shape` its sizes (rank 0..STASH_MAX_RANK; a larger rank is
 * an error, never a truncation) and `slot` tells apart several entries of one
 * anchor.
 *
 * Errors come back as a stash_status; nothing here aborts, exits or leaks.
 * Every function may be called from any thread. Release callbacks run after the
 * registry's lock is dropped, so they may call back into the registry.
 * Predicates and visitors run under the lock and must not.
 */
#ifndef ATTNSTASH_STASH_REGISTRY_H
#define ATTNSTASH_STASH_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STASH_MAX_RANK 8

typedef struct stash_key {
  uintptr_t anchor;               /* the anchor's data pointer */
  int64_t version;                /* the anchor's version counter */
  int32_t rank;                   /* number of valid sizes in shape */
  int64_t shape[STASH_MAX_RANK];  /* sizes; entries past rank are ignored */
  int64_t slot;                   /* which entry of this anchor */
} stash_key;

typedef void (*stash_release_fn)(void *payload);

typedef struct stash_entry {
  void *payload;             /* owned by the registry while held */
  size_t bytes;              /* counted in stats while held */
  stash_release_fn release;  /* drops payload when the registry discards it; may be NULL */
} stash_entry;

typedef struct stash_stats {
  size_t entries;            /* entries held now */
  size_t bytes;              /* bytes held now */
  size_t peak_bytes;         /* most bytes held at once since creation or stash_reset_peak */
  uint64_t keeps;            /* successful keeps */
  uint64_t takes;            /* successful takes */
  uint64_t misses;           /* takes that found no entry */
  uint64_t released_unused;  /* entries dropped without being taken */
} stash_stats;

typedef enum stash_status {
  STASH_OK = 0,
  STASH_ERR_ARGUMENT = 1,    /* a NULL registry, key, entry or output pointer */
  STASH_ERR_RANK = 2,        /* key rank < 0 or > STASH_MAX_RANK */
  STASH_ERR_DUPLICATE = 3,   /* keep: an entry is already held under this key */
  STASH_ERR_MISSING = 4,     /* take: no entry is held under this key */
  STASH_ERR_NOMEM = 5        /* an allocation failed; nothing was changed */
} stash_status;

/* A static, human-readable description of a status ("unknown status" if out of range). */
const char *stash_status_message(stash_status status);

typedef struct stash_registry stash_registry;

/* Create an empty registry in *out. */
stash_status stash_registry_create(stash_registry **out);

/* Release every held entry (as stash_clear) and free the registry. NULL is a no-op. */
void stash_registry_destroy(stash_registry *registry);

/* Store `entry` under `key`. On any error nothing is stored and the caller still owns entry. */
stash_status stash_keep(stash_registry *registry, const stash_key *key, stash_entry entry);

/* Remove the entry under `key` into *out; the caller now owns it. A missing key counts a miss. */
stash_status stash_take(stash_registry *registry, const stash_key *key, stash_entry *out);

/* Release every entry whose key has this anchor, whatever its version, shape and slot.
 * `released` (may be NULL) receives how many were released. */
stash_status stash_release_anchor(stash_registry *registry, uintptr_t anchor, size_t *released);

/* Release every entry for which `predicate` returns non-zero. */
typedef int (*stash_predicate_fn)(const stash_key *key, const stash_entry *entry, void *context);
stash_status stash_release_if(stash_registry *registry, stash_predicate_fn predicate, void *context,
                              size_t *released);

/* Release every entry. */
stash_status stash_clear(stash_registry *registry, size_t *released);

/* Call `visitor` on each held entry (read-only), in no particular order. */
typedef void (*stash_visit_fn)(const stash_key *key, const stash_entry *entry, void *context);
stash_status stash_visit(stash_registry *registry, stash_visit_fn visitor, void *context);

/* Call `visitor` on the entry under `key`, which stays held; STASH_ERR_MISSING if there is
 * none (not counted as a miss). The visitor runs under the lock. */
stash_status stash_peek(stash_registry *registry, const stash_key *key, stash_visit_fn visitor, void *context);

/* Copy the counters into *out. */
stash_status stash_get_stats(stash_registry *registry, stash_stats *out);

/* Set peak_bytes to the bytes held now (to measure one phase of a run). */
stash_status stash_reset_peak(stash_registry *registry);

#ifdef __cplusplus
}
#endif

#endif /* ATTNSTASH_STASH_REGISTRY_H */
