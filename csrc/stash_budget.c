/* stash_budget.c: the budget and what it counts: its bound (stash_set_max_bytes), records moved
 * off the device, whose bytes it does not count (stash_set_moved), and making room under it by the
 * rule of stash_registry.h (Budget). */
#define _POSIX_C_SOURCE 200809L

#include "stash_internal.h"

#include <stdlib.h>

stash_status registry_make_room(stash_registry *r, size_t bytes, demoted_payload **to_release) {
  stash_stats *s = &r->stats;
  if (bytes > s->max_bytes) return STASH_ERR_BUDGET;
  uint64_t room_needed = s->bytes > s->max_bytes - bytes ? s->bytes - (s->max_bytes - bytes) : 0;
  if (room_needed == 0) return STASH_OK;
  /* The victims in the rule's order, until they free enough (a record is picked once: its
   * id is taken out of the running by the `after` bound). */
  stash_status status = STASH_OK;
  size_t count = 0, capacity = 0;
  stash_node **victims = NULL;
  uint64_t freed = 0, after = 0;
  while (freed < room_needed) {
    stash_node *oldest = NULL;
    for (size_t b = 0; b < r->bucket_count; ++b) {
      for (stash_node *node = r->buckets[b]; node != NULL; node = node->next) {
        if (!node->declined && !node->moved && node->entry.demote != NULL && node->id > after &&
            (oldest == NULL || node->id < oldest->id)) {
          oldest = node;
        }
      }
    }
    if (oldest == NULL) break;
    if (count == capacity) {
      capacity = capacity ? capacity * 2 : 8;
      stash_node **grown = realloc(victims, capacity * sizeof *victims);
      if (grown == NULL) {
        status = STASH_ERR_NOMEM;
        break;
      }
      victims = grown;
    }
    victims[count++] = oldest;
    freed += oldest->entry.bytes;
    after = oldest->id;
  }
  if (status == STASH_OK && freed < room_needed) status = STASH_ERR_BUDGET;
  /* Stand-ins first, all of them, before anything changes. */
  demoted_payload *made = NULL;
  for (size_t i = 0; status == STASH_OK && i < count; ++i) {
    demoted_payload *d = malloc(sizeof *d);
    void *stand_in = d != NULL ? victims[i]->entry.demote(victims[i]->entry.payload) : NULL;
    if (stand_in == NULL) {
      status = d == NULL ? STASH_ERR_NOMEM : STASH_ERR_BUDGET; /* a record that cannot be demoted */
      free(d);
      break;
    }
    d->entry = victims[i]->entry;
    d->entry.payload = stand_in;
    d->next = made;
    made = d;
  }
  if (status != STASH_OK) { /* nothing changes; the stand-ins made in vain are released after unlocking */
    while (made != NULL) {
      demoted_payload *next = made->next;
      made->next = *to_release;
      *to_release = made;
      made = next;
    }
    free(victims);
    return status;
  }
  /* `made` lists the stand-ins in reverse order of victims. */
  for (size_t i = count; i-- > 0;) {
    demoted_payload *d = made;
    made = made->next;
    stash_node *victim = victims[i];
    void *stand_in = d->entry.payload;
    d->entry = victim->entry; /* now: the payload the record held, to release */
    d->next = *to_release;
    *to_release = d;
    s->bytes -= victim->entry.bytes;
    s->keeps -= victim->refs;
    s->declined += victim->refs;
    victim->entry.payload = stand_in;
    victim->entry.bytes = 0;
    victim->declined = 1;
  }
  free(victims);
  return STASH_OK;
}

void registry_release_demoted(demoted_payload *demoted) {
  while (demoted != NULL) {
    demoted_payload *next = demoted->next;
    if (demoted->entry.release != NULL) demoted->entry.release(demoted->entry.payload);
    free(demoted);
    demoted = next;
  }
}

stash_status stash_set_max_bytes(stash_registry *registry, uint64_t max_bytes) {
  if (registry == NULL) return STASH_ERR_ARGUMENT;
  pthread_mutex_lock(&registry->mutex);
  registry->stats.max_bytes = max_bytes;
  pthread_mutex_unlock(&registry->mutex);
  return STASH_OK;
}

stash_status stash_set_moved(stash_registry *registry, uint64_t id, int moved) {
  if (registry == NULL || id == 0) return STASH_ERR_ARGUMENT;
  moved = moved != 0;
  stash_status status = STASH_ERR_MISSING;
  pthread_mutex_lock(&registry->mutex);
  stash_stats *s = &registry->stats;
  for (size_t b = 0; b < registry->bucket_count && status == STASH_ERR_MISSING; ++b) {
    for (stash_node *node = registry->buckets[b]; node != NULL; node = node->next) {
      if (node->id != id) continue;
      status = node->declined ? STASH_ERR_ARGUMENT : STASH_OK;
      if (status == STASH_OK && node->moved != moved) {
        registry_uncount(registry, node);
        node->moved = moved;
        if (moved) {
          s->moved_bytes += node->entry.bytes;
        } else {
          s->bytes += node->entry.bytes;
          if (s->bytes > s->peak_bytes) s->peak_bytes = s->bytes;
        }
      }
      break;
    }
  }
  pthread_mutex_unlock(&registry->mutex);
  return status;
}
