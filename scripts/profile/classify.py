#!/usr/bin/env python3
"""Where a Downpour job's CPU goes, by role and by part of the exchange.
For models with tables, the keyed parts have categories of their own:
hashing and deduplicating keys and summing row gradients on the replica,
gathering and scattering embeddings, looking rows up and Adagrad on rows on
the shard.

Reads `perf script -F comm,pid,ip,sym` output of a system-wide,
call-graph (dwarf) `perf record` taken while `distbelief train` ran, and the
run directory's processes.tsv. Each sample goes to the first category that
matches a frame, leaf first, so memcpy inside the f32 codec counts as the
codec and a socket write inside hyper as the kernel's TCP. Prints each role's
share and, for the replicas and shards, CPU-microseconds per exchange (one
replica's fetch and push of the whole model, nPush steps of batchSize).

Usage: classify.py SCRIPT_TXT PROCESSES_TSV WINDOW_SECONDS SUMMARY_JSON NPUSH
(see scripts/profile/exchange.sh, which runs all of it).
"""
import collections
import csv
import sys
roles = {}
for r in csv.DictReader(open(sys.argv[2]), delimiter='\t'):
    roles[r['pid']] = r['role'] + ('' if r['role'] == 'coordinator' else r['index'])
samples = []
cur = None
for line in open(sys.argv[1]):
    if not line.startswith('\t') and line.strip():
        parts = line.split()
        cur = [parts[-1], []]
        samples.append(cur)
    elif line.strip() and cur is not None:
        f = line.strip().split(' ', 1)
        cur[1].append(f[1] if len(f) > 1 else '')
# Category rules: first rule whose marker appears anywhere in the stack (leaf first order matters).
rules = [
    ('rows: Adagrad on the shard', ['update_row', 'Table::apply', 'apply_checked']),
    ('rows: lookup, admission on the shard', ['Table::fetch', 'Table::row', 'Table::admit', 'insert_row', 'Table::check', 'Table::export']),
    ('keys: hash, dedup, row sums (replica)', ['keys::key_of', 'keys::mix', 'WideDeep::keys', 'each_key', 'RowSums', 'TableRows::new', 'TableRows::slot', 'TableRows::row', 'shard_of']),
    ('embeddings: gather, scatter (replica)', ['WideDeep::inputs', 'WideDeep::gradient']),
    ('rows: fetch and push messages (client)', ['fetch_table_rows', 'fetch_rows', 'rows_chunks']),
    ('gemm (model compute)', ['sgemm_kernel', 'packing::pack', 'distbelief_model::mlp', 'general_mat_mul']),
    ('evaluation', ['evaluat', 'Evaluat']),
    ('shard apply (adagrad)', ['adagrad', 'apply_summed', 'Shard::apply']),
    ('lookahead / local steps', ['Lookahead']),
    ('gradient into push buffer (Link::offer)', ['Link::offer']),
    ('f32 encode/decode', ['codec::encode_f32', 'decode_f32', 'encode_f32']),
    ('prost/tonic framing', ['prost::', 'tonic::codec']),
    ('http2 (h2/hyper)', ['h2::', 'hyper::']),
    ('kernel tcp/loopback', ['tcp_', 'skb', 'sock_', '__sys_', '_copy_to_iter', '_copy_from_iter']),
    ('parameters into replica (fetch copy)', ['receive_parameters', 'fetch']),
    ('tokio scheduling, wake-ups, futex', ['tokio::runtime', 'futex', 'schedule', 'park']),
    ('alloc/free', ['malloc', 'free', 'memset']),
]
by = collections.Counter(); total = collections.Counter()
for pid, stack in samples:
    role = roles.get(pid, 'other')
    cat = 'other'
    for frame in stack:  # leaf first: the most specific category
        hit = next((name for name, marks in rules if any(m in frame for m in marks)), None)
        if hit:
            cat = hit; break
    by[(role, cat)] += 1; total[role] += 1
n = len(samples)
print('samples', n)
for role in sorted(total, key=lambda r: -total[r]):
    print(f'{role:12s} {100*total[role]/n:5.1f}%')
    for (r, c), k in sorted(by.items(), key=lambda x: -x[1]):
        if r == role and k / n >= 0.003:
            print(f'   {c:42s} {100*k/n:5.1f}%')
# Per exchange: one replica's fetch and push of the whole model (both shards).
import json
window, cpus = float(sys.argv[3]), 2
s = json.load(open(sys.argv[4]))
steps_per_s = s['steps'] / s['train_seconds']
npush = int(sys.argv[5])
exchanges = steps_per_s / npush * window
per = window * cpus / n / exchanges * 1e6
print(f'exchanges in window ~{exchanges:.0f}; one sample = {window*cpus/n*1e3:.2f} ms CPU; {s["examples_per_second"]:.0f} examples/s')
# What a replica does not spend on its CPU it waits (for rows, for acks).
for role in sorted(r for r in total if r.startswith('worker')):
    busy = total[role] * cpus / n
    print(f'  {role}: busy {100*busy:.0f}% of a core, waiting or runnable {100*(1-busy):.0f}%')
cats = collections.Counter()
for (r, c), k in by.items():
    if r.startswith(('worker', 'ps')):
        cats[(('worker' if r.startswith('worker') else 'shard'), c)] += k
tot = 0
for (side, c), k in sorted(cats.items(), key=lambda x: -x[1]):
    print(f'  {side:6s} {c:42s} {k*per:7.0f} CPU-us/exchange')
