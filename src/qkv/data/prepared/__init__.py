"""A prepared folder: a tokenized parallel corpus on disk, read a batch at a time.

Made once by ``qkv prepare`` (:mod:`qkv.data.prepared.preparing`), or by ``qkv train`` inside a run
folder; read by every training process, which then holds O(batch) token data, not O(corpus). The
layout is that of fairseq's indexed datasets and nanoGPT's ``.bin`` files, one set per split
(``train``, ``valid``)::

    manifest.json        counts, dtypes, the tokenizer, where the text came from, the lines
                         dropped (and why), a fingerprint; written last
    tokenizer.json       the shared BPE tokenizer
    train.src.bin        every source sentence's ids end to end (uint16, or uint32 for
    train.tgt.bin        vocabularies over 65,536), no BOS/EOS
    train.src.idx        int64 offsets into the .bin: sentence i is [idx[i], idx[i+1])
    train.tgt.idx
    train.len            (pairs, 2) token counts (source, target): what length bucketing reads
    train.lines          int64 line number of each pair in the text files (for messages)
    verified.json        the files' SHA-256 as last checked, by size and times (a cache, written
                         when a run verifies the folder; see HashCache)

The package, one module per concept:

- :mod:`~qkv.data.prepared.format`: the names, types and manifest of a folder; the writer, the
  reader and the checks agree through it alone;
- :mod:`~qkv.data.prepared.writer`: writing a folder, built under a temporary name and renamed when
  whole (:func:`~qkv.data.prepared.writer.building_folder`), so a crash never leaves a
  half-prepared folder that looks complete;
- :mod:`~qkv.data.prepared.integrity`: the checks (offsets, length table, ids inside the
  vocabulary, every file's SHA-256, the hash cache);
- :mod:`~qkv.data.prepared.corpus`: reading (:class:`PreparedCorpus`, :class:`PreparedSplit`);
- :mod:`~qkv.data.prepared.preparing` and :mod:`~qkv.data.prepared.workers`: ``qkv prepare``,
  streaming, multi-process tokenization.

Before a run trains on a folder, and again when it resumes, :meth:`PreparedCorpus.verify` checks
that the data is what the manifest says: the offsets run from 0 to the end of the ids, the length
table agrees with them, every id is inside the vocabulary, and every file has the manifest's
SHA-256. The manifest's fingerprint is a hash of those SHA-256s (and of the tokenizer's), and a run
records it: so a resume whose folder has the run's fingerprint, and whose every file has the
manifest's SHA-256, reads the very bytes the run started on. Hashing reads every byte (about 1.4
GB/s from the page cache on a 2-core EPYC, under a second for WMT 2014's 4.5M pairs, 876 MiB; disk
speed when the files are not cached), so when a run starts the hashes kept in ``verified.json``
beside the arrays (:class:`~qkv.data.prepared.integrity.HashCache`) spare hashing a file whose
size, inode, mtime and ctime are those recorded. A resume trusts no kept hash (``verified.json`` is
as easy to write as the arrays): it hashes every file from its contents. The other checks run every
time.

Training reads a pair with ``os.pread`` from the files every process shares in the page cache,
instead of through a memory map: a map's touched pages count in each process's resident memory
until the kernel reclaims them, which over an epoch of random batches is the whole corpus per
process; ``pread`` copies only the batch. :meth:`PreparedSplit.tokens` maps a whole array, for
inspection.

The modules before the package (``qkv.data.prepared_format``, ``prepared_integrity``,
``prepared_writer``, ``preparing``, ``preparing_workers``) are still importable: each is the same
module object as its new path (:mod:`qkv.data._moved`).
"""

from qkv.data.prepared.corpus import PreparedCorpus, PreparedSplit
from qkv.data.prepared.format import FORMAT, MARKER, folder_fingerprint, is_prepared_folder, split_files, token_dtype
from qkv.data.prepared.integrity import CACHE_FILE
from qkv.data.prepared.writer import building_folder, write_token_lists

# the names the flat ``qkv.data.prepared`` module exported before it became this package
__all__ = [
    "CACHE_FILE",
    "FORMAT",
    "MARKER",
    "PreparedCorpus",
    "PreparedSplit",
    "building_folder",
    "folder_fingerprint",
    "is_prepared_folder",
    "split_files",
    "token_dtype",
    "write_token_lists",
]
