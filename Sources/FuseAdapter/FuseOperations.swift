internal import CFuse3
import Glibc
import StorageClient
import StorefsCore

// The low-level ops table. Each callback converts arguments, calls `Filesystem`, and replies;
// nothing here decides semantics or errno values (those live in StorefsCore). What may wait on
// the network (reads that miss, lookups and listings that need the bucket) is answered from a
// worker thread (`ReadDispatch`, `FuseContext`'s metadata pool).

private func context(_ req: fuse_req_t?) -> FuseContext {
    Unmanaged<FuseContext>.fromOpaque(fuse_req_userdata(req)!).takeUnretainedValue()
}

/// Replies with an error; returns the errno sent.
@discardableResult
private func reply(_ req: fuse_req_t?, _ error: FilesystemError) -> Int32 {
    let e = Errno.value(for: error.code)
    _ = fuse_reply_err(req, e)
    return e
}

/// Runs a callback's work and, if it throws, replies with the error's errno (EIO for anything
/// that is not a FilesystemError). The work itself sends the success reply. `trace` learns
/// the result.
private func answering(_ req: fuse_req_t?, _ trace: OpTrace, _ work: () throws -> Void) {
    do {
        try work()
        trace.finish()
    } catch let e as FilesystemError {
        trace.finish(reply(req, e))
    } catch {
        _ = fuse_reply_err(req, EIO)
        trace.finish(EIO)
    }
}

/// A metadata operation: first answered on this FUSE thread from what the daemon knows
/// (`Network.never`: no hop, no wait); when that needs the bucket, asked again on a metadata
/// worker, where the request's INTERRUPT (Ctrl-C, a killed caller) cancels the wait and the
/// request. `work` replies on success and throws otherwise.
private func withMetadata(_ req: fuse_req_t?, _ trace: OpTrace, _ work: @escaping @Sendable (Network, fuse_req_t?) throws -> Void) {
    do {
        try work(.never, req)
        trace.finish()
        return
    } catch let e as FilesystemError where e.code == .wouldBlock {
        // below
    } catch let e as FilesystemError {
        trace.finish(reply(req, e))
        return
    } catch {
        _ = fuse_reply_err(req, EIO)
        trace.finish(EIO)
        return
    }
    let ctx = context(req)
    let r = Request(raw: req!)
    ctx.inFlight.enter()
    // Until a worker takes it, its INTERRUPT answers it (QueuedRequests): 64 lookups stalled
    // on the server must not keep a caller that handles Ctrl-C waiting behind them.
    queue(r, .init(op: trace.op, inode: trace.inode, name: trace.name, started: trace.started), on: ctx.metadata, ctx: ctx) {
        defer { ctx.inFlight.leave() }
        let interrupted: @Sendable () -> Bool = { fuse_req_interrupted(r.raw) != 0 || ctx.isStopping }
        if interrupted() {
            let e = Errno.value(for: .storage(.cancelled))
            _ = fuse_reply_err(r.raw, e)
            trace.finish(e)
            return
        }
        answering(r.raw, trace) { try work(.allowed(isCancelled: interrupted), r.raw) }
    }
}

/// Hands `r` to a worker of `pool`: until one takes it, its INTERRUPT answers it EINTR
/// (`QueuedRequests`), and `work` then never runs. Registered after the entry, since libfuse
/// calls back at once for an INTERRUPT already received. The caller counted the reply owed
/// (`inFlight`); whoever answers it uncounts it (`work` itself, or the interrupt callback).
private func queue(_ r: Request, _ entry: QueuedRequests.Entry, on pool: WorkerPool, ctx: FuseContext,
                   skipped: @escaping @Sendable () -> Void = {}, _ work: @escaping @Sendable () -> Void) {
    ctx.queued.add(r, entry)
    fuse_req_interrupt_func(r.raw, queuedRequestInterrupted, nil)
    pool.submit {
        guard ctx.queued.take(r) else { return skipped() }  // answered at its INTERRUPT
        work()
    }
}

/// libfuse's interrupt callback for a request waiting for a worker (`QueuedRequests`): answers
/// it EINTR if no worker has taken it yet. Called on the thread that read the INTERRUPT (or on
/// the one registering, for an INTERRUPT already received), with the request still alive.
private let queuedRequestInterrupted: fuse_interrupt_func_t = { req, _ in
    let ctx = context(req)
    guard let entry = ctx.queued.interrupted(req!) else { return }  // a worker serves it
    let e = Errno.value(for: .storage(.cancelled))
    _ = fuse_reply_err(req, e)
    OpTrace.record(entry.op, inode: entry.inode, name: entry.name, errno: e, started: entry.started)
    ctx.inFlight.leave()
}

private func replyReadOnly(_ req: fuse_req_t?, _ op: FuseOp, _ inode: fuse_ino_t) {
    let e = Errno.value(for: .readOnly)
    _ = fuse_reply_err(req, e)
    OpTrace.record(op, inode: UInt64(inode), errno: e, started: monotonicNow())
}

/// The uid of the process behind a request (who asks for a capability attribute).
private func requester(_ req: fuse_req_t?) -> UInt32 {
    fuse_req_ctx(req)?.pointee.uid ?? UInt32.max
}

func fileType(_ kind: FileAttributes.Kind) -> mode_t {
    switch kind {
    case .directory: return S_IFDIR
    case .file: return S_IFREG
    case .symlink: return S_IFLNK
    }
}

func makeStat(_ a: FileAttributes) -> stat {
    var st = stat()
    st.st_ino = __ino_t(a.inode)
    st.st_mode = fileType(a.kind) | mode_t(a.mode)
    st.st_nlink = __nlink_t(a.linkCount)
    st.st_uid = a.uid
    st.st_gid = a.gid
    st.st_size = Int(a.size)
    st.st_blksize = 1 << 20
    st.st_blocks = Int(a.size / 512 + (a.size % 512 == 0 ? 0 : 1))  // no overflow for any size
    let ts = timespec(tv_sec: Int(a.modified.seconds), tv_nsec: Int(a.modified.nanoseconds))
    st.st_mtim = ts
    st.st_ctim = ts
    st.st_atim = ts
    return st
}

private func replyEntry(_ req: fuse_req_t?, _ attributes: FileAttributes, timeout: Double) {
    var entry = fuse_entry_param()
    entry.ino = fuse_ino_t(attributes.inode)
    entry.generation = 1
    entry.attr = makeStat(attributes)
    entry.attr_timeout = timeout
    entry.entry_timeout = timeout
    _ = fuse_reply_entry(req, &entry)
}

private func replyXattr(_ req: fuse_req_t?, _ value: [UInt8], size: Int) {
    if size == 0 {
        _ = fuse_reply_xattr(req, value.count)
    } else if size < value.count {
        _ = fuse_reply_err(req, Errno.value(for: .bufferTooSmall))
    } else {
        _ = value.withUnsafeBytes { fuse_reply_buf(req, $0.baseAddress?.assumingMemoryBound(to: CChar.self), value.count) }
    }
}

func makeOperations() -> fuse_lowlevel_ops {
    var ops = fuse_lowlevel_ops()

    ops.`init` = { userdata, conn in
        guard let conn else { return }
        // Lookups and listings of one directory need not wait for each other.
        conn.pointee.want |= conn.pointee.capable & UInt32(FUSE_CAP_PARALLEL_DIROPS)
        // With the bdi read_ahead_kb raised at mount, this makes sequential reads arrive as 1 MiB requests.
        conn.pointee.max_readahead = UInt32(FuseSession.maxRequestSize)
        conn.pointee.want |= conn.pointee.capable & UInt32(FUSE_CAP_ASYNC_READ)
        // Readahead reads are background requests, 12 in flight by default: 16 threads each
        // reading a small file, or 4 streams of one mmap, queued in the kernel behind 12 reads
        // waiting on the network. As many as there are read workers may wait at once.
        conn.pointee.max_background = 64
        conn.pointee.congestion_threshold = 48
        // O_DIRECT reads as requests of the reading thread: a signal it handles (Ctrl-C in
        // `storefs prefetch`) then reaches the daemon as an INTERRUPT. With libfuse's default
        // async direct I/O the reader sleeps uninterruptibly until the download ends
        // (docs/fuse-notes.md, item 5).
        conn.pointee.want &= ~UInt32(FUSE_CAP_ASYNC_DIO)
        conn.pointee.want |= conn.pointee.capable & UInt32(FUSE_CAP_AUTO_INVAL_DATA)
        // The kernel keeps a symlink's target in its page cache (stat_ttl bounds it, as data).
        conn.pointee.want |= conn.pointee.capable & UInt32(FUSE_CAP_CACHE_SYMLINKS)
        Log.debug("fuse init capable=0x\(String(conn.pointee.capable, radix: 16)) want=0x\(String(conn.pointee.want, radix: 16))")
    }

    ops.lookup = { req, parent, name in
        let fs = context(req).fs
        // Object names are UTF-8: a name that is not cannot be one (and must not be
        // "repaired" into another object's name).
        guard let child = String(validatingCString: name!) else {
            let e = Errno.value(for: .noEntry)
            _ = fuse_reply_err(req, e)
            OpTrace.record(.lookup, inode: UInt64(parent), name: Log.escaped(String(cString: name!)), errno: e, started: monotonicNow())
            return
        }
        let trace = OpTrace(.lookup, inode: UInt64(parent), name: child)
        withMetadata(req, trace) { network, req in
            do {
                let a = try fs.lookup(parent: UInt64(parent), name: child, network: network)
                replyEntry(req, a, timeout: fs.config.statTTL)
            } catch let e as FilesystemError where e.code == .noEntry && fs.config.negativeTTL > 0 {
                // ino 0 = a negative entry the kernel may cache for negative_ttl.
                var entry = fuse_entry_param()
                entry.entry_timeout = fs.config.negativeTTL
                _ = fuse_reply_entry(req, &entry)
                trace.result = ENOENT
            }
        }
    }

    ops.forget = { req, ino, nlookup in
        let started = monotonicNow()
        context(req).fs.forget(UInt64(ino), count: UInt64(nlookup))
        fuse_reply_none(req)
        OpTrace.record(.forget, inode: UInt64(ino), errno: 0, started: started)
    }

    ops.forget_multi = { req, count, forgets in
        let fs = context(req).fs
        for i in 0..<count {
            let f = forgets![i]
            fs.forget(UInt64(f.ino), count: UInt64(f.nlookup))
        }
        fuse_reply_none(req)
        Metrics.shared.operations(FuseOp.forget.rawValue, count: count)
    }

    ops.getattr = { req, ino, _ in
        let fs = context(req).fs
        withMetadata(req, OpTrace(.getattr, inode: UInt64(ino))) { network, req in
            var st = makeStat(try fs.attributes(of: UInt64(ino), network: network))
            _ = fuse_reply_attr(req, &st, fs.config.statTTL)
        }
    }

    ops.readlink = { req, ino in
        let fs = context(req).fs
        withMetadata(req, OpTrace(.readlink, inode: UInt64(ino))) { network, req in
            let target = try fs.readLink(UInt64(ino), network: network)
            _ = fuse_reply_readlink(req, target)
        }
    }

    ops.opendir = { req, ino, fi in
        let fs = context(req).fs
        let copy = FileInfo(info: fi!.pointee)
        withMetadata(req, OpTrace(.opendir, inode: UInt64(ino))) { network, req in
            // Answered as soon as readdir can start (after a listing's first page); this
            // worker then fetches the rest of the listing for the handle.
            let opened: OpenedDirectory = try fs.openDirectory(UInt64(ino), network: network)
            var info = copy.info
            info.fh = opened.handle
            info.cache_readdir = 0
            _ = fuse_reply_open(req, &info)
            opened.finishListing()
        }
    }

    ops.readdir = { req, ino, size, off, fi in
        let fs = context(req).fs
        let handle = fi!.pointee.fh
        // Waits (on a worker) only while the directory's listing has not reached `off` yet.
        withMetadata(req, OpTrace(.readdir, inode: UInt64(ino))) { network, req in
            // A dirent takes at least 32 bytes: no more entries than fit are made.
            let entries = try fs.readDirectory(handle, from: Int(off), limit: size / 32 + 1, network: network)
            var buffer = [CChar](repeating: 0, count: size)
            let used = try buffer.withUnsafeMutableBufferPointer { out in
                try DirectoryReply.pack(entries, into: size, entrySize: { fuse_add_direntry(req, nil, 0, $0.name, nil, 0) }) { e, at in
                    var st = stat()
                    st.st_ino = __ino_t(e.inode)
                    st.st_mode = fileType(e.kind)
                    _ = fuse_add_direntry(req, out.baseAddress! + at, size - at, e.name, &st, off_t(e.nextOffset))
                }
            }
            _ = fuse_reply_buf(req, buffer, used)
        }
    }

    ops.readdirplus = { req, ino, size, off, fi in
        let fs = context(req).fs
        let handle = fi!.pointee.fh
        withMetadata(req, OpTrace(.readdirplus, inode: UInt64(ino))) { network, req in
            // The kernel asks for attributes at offset 0 whether or not anyone wants them, and
            // recent kernels ask for as much as the caller's buffer (~6,000 entries for `find`):
            // each entry sent is an inode we must keep while the kernel holds it. Answering a
            // page's worth there, as older kernels asked, lets `find` go on with plain readdir;
            // `ls -l` stats those entries, and the kernel then asks for attributes in full.
            let size = off == 0 ? min(size, DirectoryReply.firstPlusReplyBytes) : size
            // A direntplus takes at least 152 bytes (entry_out + dirent): no more are made.
            let entries = try fs.readDirectory(handle, from: Int(off), limit: size / 152 + 1, network: network)
            let sizes = entries.map { fuse_add_direntry_plus(req, nil, 0, $0.name, nil, 0) }
            let fit = DirectoryReply.fitting(sizes, into: size)
            // Counted as lookups only now that these entries are sure to be sent, all at once.
            let listed = fit == 0 ? [] : try fs.lookupListed(handle, offsets: Int(off)..<(Int(off) + fit))
            var buffer = [CChar](repeating: 0, count: size)
            var used = 0
            buffer.withUnsafeMutableBufferPointer { out in
                for (k, e) in entries.prefix(fit).enumerated() {
                    var param = fuse_entry_param()
                    if let a = listed[k] {
                        param.ino = fuse_ino_t(a.inode)
                        param.generation = 1
                        param.attr = makeStat(a)
                        param.attr_timeout = fs.config.statTTL
                        param.entry_timeout = fs.config.statTTL
                    } else {
                        // `.`, `..`, or a name whose size needs a request (v0): the name alone.
                        // ino 0 = no attributes, no kernel reference; it looks the name up
                        // if it needs more (a `find` never does).
                        param.attr.st_ino = __ino_t(e.inode)
                        param.attr.st_mode = fileType(e.kind)
                    }
                    used += fuse_add_direntry_plus(req, out.baseAddress! + used, size - used, e.name, &param, off_t(e.nextOffset))
                }
            }
            _ = fuse_reply_buf(req, buffer, used)
        }
    }

    ops.releasedir = { req, ino, fi in
        let started = monotonicNow()
        context(req).fs.release(fi!.pointee.fh)
        _ = fuse_reply_err(req, 0)
        OpTrace.record(.releasedir, inode: UInt64(ino), errno: 0, started: started)
    }

    ops.open = { req, ino, fi in
        let fs = context(req).fs
        let copy = FileInfo(info: fi!.pointee)
        withMetadata(req, OpTrace(.open, inode: UInt64(ino))) { network, req in
            var info = copy.info
            let opened = try fs.open(UInt64(ino), flags: info.flags, network: network)
            info.fh = opened.handle
            info.keep_cache = opened.keepCache ? 1 : 0
            _ = fuse_reply_open(req, &info)
        }
    }

    ops.read = { req, ino, size, off, fi in
        let ctx = context(req)
        let request = FuseReadRequest(raw: req!, ctx: ctx)
        let inode = UInt64(ino)
        ctx.reads.serve(request, inode: inode, handle: fi!.pointee.fh, offset: Int64(off), size: size) { work, skipped in
            // The reply is owed from a worker: counted until it is made (or its INTERRUPT
            // answers it while it waits, QueuedRequests).
            ctx.inFlight.enter()
            queue(Request(raw: req!), .init(op: .read, inode: inode, name: nil, started: monotonicNow()), on: ctx.workers,
                  ctx: ctx, skipped: skipped) {
                defer { ctx.inFlight.leave() }
                work()
            }
        }
    }

    ops.release = { req, ino, fi in
        let started = monotonicNow()
        context(req).fs.release(fi!.pointee.fh)
        _ = fuse_reply_err(req, 0)
        OpTrace.record(.release, inode: UInt64(ino), errno: 0, started: started)
    }

    ops.getxattr = { req, ino, name, size in
        let fs = context(req).fs
        let attribute = String(cString: name!)
        let uid = requester(req)
        withMetadata(req, OpTrace(.getxattr, inode: UInt64(ino), name: attribute)) { network, req in
            replyXattr(req, try fs.extendedAttribute(UInt64(ino), name: attribute, requester: uid, network: network), size: size)
        }
    }

    ops.listxattr = { req, ino, size in
        let fs = context(req).fs
        let uid = requester(req)
        withMetadata(req, OpTrace(.listxattr, inode: UInt64(ino))) { network, req in
            var list: [UInt8] = []
            for name in try fs.extendedAttributeNames(UInt64(ino), requester: uid, network: network) { list += Array(name.utf8) + [0] }
            replyXattr(req, list, size: size)
        }
    }

    // The block cache's capacity and free space, and names remembered (README, "Stats and metrics").
    ops.statfs = { req, ino in
        let started = monotonicNow()
        let usage = context(req).fs.usage()
        var st = statvfs()
        st.f_bsize = UInt(usage.blockSize)
        st.f_frsize = UInt(usage.blockSize)
        st.f_blocks = fsblkcnt_t(usage.blocks)
        st.f_bfree = fsblkcnt_t(usage.freeBlocks)
        st.f_bavail = fsblkcnt_t(usage.freeBlocks)
        st.f_files = fsfilcnt_t(usage.files)
        st.f_ffree = fsfilcnt_t(usage.freeFiles)
        st.f_favail = fsfilcnt_t(usage.freeFiles)
        st.f_namemax = UInt(usage.maxNameLength)
        st.f_flag = UInt(ST_RDONLY)
        _ = fuse_reply_statfs(req, &st)
        OpTrace.record(.statfs, inode: UInt64(ino), errno: 0, started: started)
    }

    // Everything that would change the bucket.
    ops.setattr = { req, ino, _, _, _ in replyReadOnly(req, .setattr, ino) }
    ops.mknod = { req, ino, _, _, _ in replyReadOnly(req, .mknod, ino) }
    ops.mkdir = { req, ino, _, _ in replyReadOnly(req, .mkdir, ino) }
    ops.unlink = { req, ino, _ in replyReadOnly(req, .unlink, ino) }
    ops.rmdir = { req, ino, _ in replyReadOnly(req, .rmdir, ino) }
    ops.symlink = { req, _, ino, _ in replyReadOnly(req, .symlink, ino) }
    ops.rename = { req, ino, _, _, _, _ in replyReadOnly(req, .rename, ino) }
    ops.link = { req, ino, _, _ in replyReadOnly(req, .link, ino) }
    ops.create = { req, ino, _, _, _ in replyReadOnly(req, .create, ino) }
    ops.write = { req, ino, _, _, _, _ in replyReadOnly(req, .write, ino) }
    ops.setxattr = { req, ino, _, _, _, _ in replyReadOnly(req, .setxattr, ino) }
    ops.removexattr = { req, ino, _ in replyReadOnly(req, .removexattr, ino) }
    ops.fallocate = { req, ino, _, _, _, _ in replyReadOnly(req, .fallocate, ino) }
    return ops
}
