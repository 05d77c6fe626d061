/* stash_registry.h: the contract of attnstash's stash registry.
 *
 * A thread-safe map from a key to a record, kept from an attention forward until
 * its recompute takes it back. Plain C11: it knows nothing of Python or tensors.
 *
 * Words, used in one sense each across C, C++ and Python:
 *   anchor    the tensor that ties a recompute to its first forward (the checkpointed layer's
 *             input); its data pointer, version and shape are part of the key.
 *   slot      which attention call of one anchor: a layer's k-th call is slot base + k, its
 *             base the first slot of a range of STASH_SLOTS_PER_RANGE the registry handed out
 *             (stash_new_slot_range), so that no two layers share a slot.
 *   key       (anchor, version, shape, slot).
 *   entry     what the caller hands the registry to hold: a payload pointer, its size in
 *             bytes and its callbacks (retain, release, demote).
 *   payload   what an entry points to, opaque here (in C++, a Payload: the attention call and
 *             the record's state, torch_ops/records.h).
 *   record    what the registry holds under a key: an entry, an id, and a count of the
 *             forwards that share it. A record is kept or declined.
 *   kept      a record that holds its bytes (the attention output and log-sum-exp).
 *   declined  a record that holds 0 bytes: the budget had no room for it, and its recompute
 *             runs attention itself. A record is declined when it is stored (stash_decline)
 *             or demoted later.
 *   demoted   a kept record turned declined to make room for a newer keep (Budget below);
 *             its payload is replaced by the stand-in its demote callback returns.
 *   take      a recompute taking a record back (one reference); release: dropping one.
 *   moved     a kept record whose tensors the caller moved off the device (offloading:
 *             attnstash/install/offload.py) until its recompute; its bytes count in
 *             moved_bytes instead of bytes, so the budget, which caps bytes, leaves it out
 *             and never demotes it. Moving it back (for its recompute) is never refused.
 *
 * Records. Each stored record gets an id, unique for the registry's lifetime (ids
 * start at 1; 0 means "none" or "any"), and a count of references, one per forward
 * that keeps it. A forward that repeats one already held under the same key (the
 * caller has checked that they are interchangeable) shares its record with
 * stash_share instead of storing a second copy.
 *
 * Ownership. The registry owns one reference to a record's payload while it holds
 * the record, however many forwards share it. A take hands out an owned reference:
 * the registry's own when the record's last forward takes it (the record is
 * unlinked), or a new one made with `retain` while other forwards still share it.
 * The registry calls `release` once for each record it drops without handing it out
 * (release_id of its last forward, release_if, clear, destroy), and never for a
 * reference it handed out: whoever took it releases it.
 *
 * Budget. max_bytes caps the bytes held at any moment (default: no cap). A keep that
 * would pass it first makes room by demoting the oldest kept records (lowest ids) whose
 * entries can be demoted (a `demote` callback), and their forwards count as declined
 * instead of kept. In a training step the oldest records are the first layers', held
 * longest (until the end of backward), so the budget goes to the last layers. If
 * demoting every such record would not make room, nothing is demoted or stored and the
 * keep returns STASH_ERR_BUDGET; the caller may then store a declined record with
 * stash_decline. Lowering the budget below the bytes held changes no record: the next
 * keep demotes, or is refused, by the same rule. This is the one statement of the budget
 * rule; every other place points here. What relies on it: the planner's and the benchmark's
 * "the last n layers that fit" (attnstash/planner/results.py, layers_within;
 * benchmarks/harness.py, predicted_bytes), tests/python/test_budget.py and
 * tests/cpp/test_registry_demotion*.cpp with the reference model in tests/cpp/registry_model.cpp.
 *
 * Keys: a key's `shape` holds rank sizes (rank 0..STASH_MAX_RANK; a larger rank is an
 * error, never a truncation).
 *
 * Errors come back as a stash_status; nothing here aborts, exits or leaks. Every
 * function may be called from any thread. Release callbacks run after the
 * registry's lock is dropped, so they may call back into the registry. Retain and
 * demote callbacks, predicates and visitors run under the lock and must not.
 */
#ifndef ATTNSTASH_STASH_REGISTRY_H
#define ATTNSTASH_STASH_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STASH_MAX_RANK 8

/* How many slots a range holds: the most attention calls one forward of a layer may make. */
#define STASH_SLOT_BITS 16
#define STASH_SLOTS_PER_RANGE ((int64_t)1 << STASH_SLOT_BITS)

typedef struct stash_key {
  uintptr_t anchor;               /* the anchor's data pointer */
  int64_t version;                /* the anchor's version counter */
  int32_t rank;                   /* number of valid sizes in shape */
  int64_t shape[STASH_MAX_RANK];  /* sizes; entries past rank are ignored */
  int64_t slot;                   /* which attention call of this anchor */
} stash_key;

typedef void (*stash_payload_fn)(void *payload);

/* A declined stand-in for `payload` (a new payload with one reference, for the registry),
 * or NULL if none can be made (then the record stays kept). */
typedef void *(*stash_demote_fn)(void *payload);

typedef struct stash_entry {
  void *payload;             /* one reference is owned by the registry while held */
  size_t bytes;              /* counted in stats while held (declined records: 0) */
  stash_payload_fn retain;   /* adds a reference to payload; may be NULL if never shared */
  stash_payload_fn release;  /* drops a reference to payload; may be NULL */
  stash_demote_fn demote;    /* makes room under the budget; NULL: never demoted */
} stash_entry;

/* A held record, as predicates and visitors see it (under the lock). */
typedef struct stash_record {
  const stash_key *key;
  const stash_entry *entry;
  uint64_t id;
  uint32_t refs;   /* forwards that share it, >= 1 */
  int declined;    /* non-zero: stored by stash_decline */
  int moved;       /* non-zero: moved off the device (stash_set_moved) */
} stash_record;

/* The counters, each with its meaning: the one list that every layer above reads
 * (C++ names them from it, Python gets them as a dict). X(name, "meaning"). */
#define STASH_STATS_FIELDS(X)                                                                      \
  X(records, "records held now (forwards that repeat one another share one)")                      \
  X(bytes, "bytes held now on the device (kept records not moved off it)")                         \
  X(peak_bytes, "most bytes held at once since the stash was created or its peak was reset")       \
  X(max_bytes, "the budget: most bytes held at once (none: UINT64_MAX in C, -1 in C++ and Python)") \
  X(keeps, "forwards whose attention output and log-sum-exp were kept")                             \
  X(declined, "forwards whose keep the budget declined: their recompute runs attention itself")    \
  X(replays, "recomputes that took a kept output back instead of running attention")               \
  X(misses, "recomputes that looked for a kept output and found none")                             \
  X(released_unused, "forwards whose record was dropped before a recompute took or read it (graph dropped, cleared)") \
  X(moved_bytes, "bytes of kept records moved off the device until their recompute (offloading)")

typedef struct stash_stats {
#define STASH_STATS_MEMBER(name, meaning) uint64_t name;
  STASH_STATS_FIELDS(STASH_STATS_MEMBER)
#undef STASH_STATS_MEMBER
} stash_stats;

typedef enum stash_status {
  STASH_OK = 0,
  STASH_ERR_ARGUMENT = 1,    /* a NULL registry, key, entry, callback or output pointer */
  STASH_ERR_RANK = 2,        /* key rank < 0 or > STASH_MAX_RANK */
  STASH_ERR_DUPLICATE = 3,   /* keep/decline: a record is already held under this key */
  STASH_ERR_MISSING = 4,     /* no record is held under this key (with this id) */
  STASH_ERR_NOMEM = 5,       /* an allocation failed; nothing was changed */
  STASH_ERR_BUDGET = 6       /* keep: the entry would pass max_bytes; nothing was stored */
} stash_status;

/* A static, human-readable description of a status ("unknown status" if out of range). */
const char *stash_status_message(stash_status status);

typedef struct stash_registry stash_registry;

/* Create an empty registry in *out, with no budget. */
stash_status stash_registry_create(stash_registry **out);

/* Release every held record (as stash_clear) and free the registry. NULL is a no-op. */
void stash_registry_destroy(stash_registry *registry);

/* Store `entry` under `key` as a kept record (demoting older records to make room under
 * the budget, see above); *id (may be NULL) receives its id. On any error nothing is
 * stored or demoted, and the caller still owns its reference to the payload. */
stash_status stash_keep(stash_registry *registry, const stash_key *key, stash_entry entry, uint64_t *id);

/* Store `entry` under `key` as a declined record (its bytes are not counted), as stash_keep
 * does otherwise; never refused by the budget. */
stash_status stash_decline(stash_registry *registry, const stash_key *key, stash_entry entry, uint64_t *id);

/* One more forward shares the record with this key and id: its reference count grows by
 * one, and keeps (or declined) by one. STASH_ERR_MISSING if there is no such record;
 * STASH_ERR_ARGUMENT if its entry has no retain callback. */
stash_status stash_share(stash_registry *registry, const stash_key *key, uint64_t id);

/* Take one reference of the record under `key` (and with this id, unless id is 0) into
 * *out, which the caller now owns; *id_out and *declined_out (each may be NULL) receive the
 * record's id and whether it is declined. The record is unlinked with its last reference.
 * A missing record counts a miss. */
stash_status stash_take(stash_registry *registry, const stash_key *key, uint64_t id, stash_entry *out,
                        uint64_t *id_out, int *declined_out);

/* As stash_take, but the record stays held with all its references: the caller gets a reference
 * of its own (the entry's retain callback; STASH_ERR_ARGUMENT if it has none). For a recompute
 * that may run again (a backward that keeps its graph); a replay or a miss counts as in
 * stash_take. */
stash_status stash_read(stash_registry *registry, const stash_key *key, uint64_t id, stash_entry *out,
                        uint64_t *id_out, int *declined_out);

/* Drop one reference of the record with this id, wherever it is held (it is unlinked with
 * its last reference). STASH_ERR_MISSING, and no miss counted, if there is none. */
stash_status stash_release_id(stash_registry *registry, uint64_t id);

/* Drop every record (all its references) for which `predicate` returns non-zero.
 * `released` (may be NULL) receives how many records were dropped. */
typedef int (*stash_predicate_fn)(const stash_record *record, void *context);
stash_status stash_release_if(stash_registry *registry, stash_predicate_fn predicate, void *context,
                              size_t *released);

/* Drop every record of `anchor` (its key's anchor, whatever its version, shape and slot; all
 * its references) for which `predicate` returns non-zero, or every one if `predicate` is NULL.
 * Only that anchor's records are looked at (they share one chain of the table), so the cost does
 * not grow with what other anchors hold. `released` (may be NULL) receives how many were dropped. */
stash_status stash_release_anchor(stash_registry *registry, uintptr_t anchor, stash_predicate_fn predicate,
                                  void *context, size_t *released);

/* Drop every record. */
stash_status stash_clear(stash_registry *registry, size_t *released);

/* Call `visitor` on each held record (read-only), in no particular order. */
typedef void (*stash_visit_fn)(const stash_record *record, void *context);
stash_status stash_visit(stash_registry *registry, stash_visit_fn visitor, void *context);

/* Call `visitor` on the record under `key`, which stays held; STASH_ERR_MISSING if there is
 * none (not counted as a miss). */
stash_status stash_peek(stash_registry *registry, const stash_key *key, stash_visit_fn visitor, void *context);

/* Mark the kept record with this id moved off the device (moved non-zero) or back on it (0):
 * its bytes go from bytes to moved_bytes or back (back: never refused by the budget, and
 * counted in peak_bytes). STASH_ERR_MISSING if there is no such record, STASH_ERR_ARGUMENT if
 * it is declined (it holds nothing to move). Setting the state it has changes nothing. */
stash_status stash_set_moved(stash_registry *registry, uint64_t id, int moved);

/* Copy the counters into *out. */
stash_status stash_get_stats(stash_registry *registry, stash_stats *out);

/* Set peak_bytes to the bytes held now (to measure one phase of a run). */
stash_status stash_reset_peak(stash_registry *registry);

/* A range of slots no other caller of this registry has had or will have: *first receives its
 * first slot (a positive multiple of STASH_SLOTS_PER_RANGE), the range being [*first, *first +
 * STASH_SLOTS_PER_RANGE). One per stashed layer (and per compiled layer class): records of
 * different layers never share a key, whatever anchor, install or thread they come from. The
 * range [0, STASH_SLOTS_PER_RANGE) is never handed out: it is left to callers of the ops that
 * choose their slots themselves (README.md, the ops in a custom model).
 * STASH_ERR_NOMEM once every range has been handed out (2^47 of them). */
stash_status stash_new_slot_range(stash_registry *registry, int64_t *first);

/* Set the budget (UINT64_MAX: no cap). Records already held stay, even above it (see Budget). */
stash_status stash_set_max_bytes(stash_registry *registry, uint64_t max_bytes);

#ifdef __cplusplus
}
#endif

#endif /* ATTNSTASH_STASH_REGISTRY_H */
