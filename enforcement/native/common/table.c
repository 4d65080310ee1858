/* Open-addressing hash map for allocation bookkeeping (pointer/handle -> bytes). */
#include <stdlib.h>
#include <string.h>

#include "qgpu_common.h"

#define EMPTY 0
#define DELETED 1

static uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

static int grow(qgpu_table_t *t) {
    size_t ncap = t->cap ? t->cap * 2 : 256;
    qgpu_entry_t *ns = calloc(ncap, sizeof *ns);
    if (!ns) return -1;
    for (size_t i = 0; i < t->cap; i++) {
        qgpu_entry_t *e = &t->slots[i];
        if (e->key <= DELETED) continue;
        size_t j = mix(e->key) & (ncap - 1);
        while (ns[j].key != EMPTY) j = (j + 1) & (ncap - 1);
        ns[j] = *e;
    }
    free(t->slots);
    t->slots = ns;
    t->cap = ncap;
    t->used = t->live;
    return 0;
}

/* keys 0 and 1 are reserved markers: shift them out of the way */
static uint64_t fix(uint64_t key) { return key <= DELETED ? key | (1ULL << 63) : key; }

int qgpu_table_put(qgpu_table_t *t, uint64_t key, uint64_t size, int64_t tag) {
    key = fix(key);
    pthread_mutex_lock(&t->lock);
    if ((t->used + 1) * 2 > t->cap && grow(t) != 0) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    size_t j = mix(key) & (t->cap - 1), tomb = (size_t)-1;
    while (t->slots[j].key != EMPTY) {
        if (t->slots[j].key == key) break;
        if (t->slots[j].key == DELETED && tomb == (size_t)-1) tomb = j;
        j = (j + 1) & (t->cap - 1);
    }
    if (t->slots[j].key != key) {
        if (tomb != (size_t)-1) {
            j = tomb;
        } else {
            t->used++;
        }
        t->live++;
    }
    t->slots[j].key = key;
    t->slots[j].size = size;
    t->slots[j].tag = tag;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

static qgpu_entry_t *find(qgpu_table_t *t, uint64_t key) {
    if (!t->cap) return NULL;
    size_t j = mix(key) & (t->cap - 1);
    while (t->slots[j].key != EMPTY) {
        if (t->slots[j].key == key) return &t->slots[j];
        j = (j + 1) & (t->cap - 1);
    }
    return NULL;
}

int qgpu_table_take(qgpu_table_t *t, uint64_t key, uint64_t *size, int64_t *tag) {
    key = fix(key);
    pthread_mutex_lock(&t->lock);
    qgpu_entry_t *e = find(t, key);
    if (!e) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    if (size) *size = e->size;
    if (tag) *tag = e->tag;
    e->key = DELETED;
    t->live--;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

int qgpu_table_get(qgpu_table_t *t, uint64_t key, uint64_t *size, int64_t *tag) {
    key = fix(key);
    pthread_mutex_lock(&t->lock);
    qgpu_entry_t *e = find(t, key);
    if (e) {
        if (size) *size = e->size;
        if (tag) *tag = e->tag;
    }
    pthread_mutex_unlock(&t->lock);
    return e ? 0 : -1;
}

size_t qgpu_table_take_if(qgpu_table_t *t, int (*pred)(uint64_t key, uint64_t size, int64_t tag),
                          qgpu_entry_t *out, size_t max) {
    size_t n = 0;
    pthread_mutex_lock(&t->lock);
    for (size_t i = 0; i < t->cap && n < max; i++) {
        qgpu_entry_t *e = &t->slots[i];
        if (e->key <= DELETED) continue;
        uint64_t key = (e->key & (1ULL << 63)) && (e->key & ~(1ULL << 63)) <= DELETED
                           ? e->key & ~(1ULL << 63)
                           : e->key;
        if (!pred(key, e->size, e->tag)) continue;
        out[n] = *e;
        out[n].key = key;
        n++;
        e->key = DELETED;
        t->live--;
    }
    pthread_mutex_unlock(&t->lock);
    return n;
}

int qgpu_table_find_range(qgpu_table_t *t, uint64_t addr, uint64_t *key, uint64_t *size) {
    int found = -1;
    pthread_mutex_lock(&t->lock);
    for (size_t i = 0; i < t->cap && found; i++) {
        qgpu_entry_t *e = &t->slots[i];
        if (e->key <= DELETED || addr < e->key || addr - e->key >= e->size) continue;
        if (key) *key = e->key;
        if (size) *size = e->size;
        found = 0;
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}
