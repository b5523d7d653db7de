import StorageClient

/// `storefs manifest`'s one listing of a source (docs/manifest.md, "Making a manifest"):
/// over the GCS JSON API, the objects under the prefix at any depth, a thousand a request
/// (no delimiter); over Firebase v0, whose listings give names only, directory by directory
/// with one metadata GET per object (16 at a time). Placeholders (`dir/`) are written too:
/// they make empty directories.
public enum ManifestListing {
    public struct Progress: Sendable {
        public var objects = 0
        public var bytes: Int64 = 0
        public var listRequests = 0
        public var metadataRequests = 0

        public init() {}
    }

    /// Writes every object under `reference` to `writer`; `report` is called after each page.
    public static func run(store: ObjectStore, reference: StorageReference, writer: ManifestWriter,
                           report: (Progress) -> Void) throws(ManifestError) {
        var progress = Progress()
        let prefix = reference.rootListingPrefix
        do throws(StorageError) {
            if let gcs = store as? GCSJSONStore {
                var token: String? = nil
                var seen = Set<String>()
                repeat {
                    let page = try gcs.listAll(prefix: prefix, pageToken: token)
                    progress.listRequests += 1
                    for item in page.items where item.name.hasBytePrefix(prefix) {
                        try writeOrThrow(writer, item)
                        progress.objects += 1
                        progress.bytes += item.size
                    }
                    token = page.nextPageToken
                    if let t = token, !seen.insert(t).inserted {
                        throw StorageError(.invalidResponse, "list gs://\(reference.bucket)/\(prefix): the server repeated a page token (the listing loops)")
                    }
                    report(progress)
                } while token != nil
            } else {
                try walk(store, prefix: prefix, writer: writer, progress: &progress, report: report)
            }
        } catch {
            throw ManifestError(error.message)
        }
    }

    /// Directory by directory, each object's metadata asked for (listings without sizes).
    private static func walk(_ store: ObjectStore, prefix: String, writer: ManifestWriter, progress: inout Progress,
                             report: (Progress) -> Void) throws(StorageError) {
        var pending = [prefix]
        while let dir = pending.popLast() {
            var token: String? = nil
            var seen = Set<String>()
            repeat {
                let page = try store.list(prefix: dir, pageToken: token, isCancelled: nil)
                progress.listRequests += 1
                var names = page.items.map(\.name).filter { $0.hasBytePrefix(dir) }
                var complete: [ObjectMetadata] = []
                if page.metadataComplete {
                    complete = page.items
                    names = []
                }
                let fetched = ParallelMap.run(names, width: 16) { name -> Result<ObjectMetadata, StorageError> in
                    Result { () throws(StorageError) in try store.metadata(of: name, isCancelled: nil) }
                }
                progress.metadataRequests += names.count
                for r in fetched {
                    switch r {
                    case .success(let m): complete.append(m)
                    case .failure(let e) where e.code == .notFound: continue  // deleted since the listing
                    case .failure(let e): throw e
                    }
                }
                for item in complete {
                    try writeOrThrow(writer, item)
                    progress.objects += 1
                    progress.bytes += item.size
                }
                pending += page.prefixes.filter { $0.hasBytePrefix(dir) && $0.utf8.count > dir.utf8.count }.reversed()
                token = page.nextPageToken
                if let t = token, !seen.insert(t).inserted {
                    throw StorageError(.invalidResponse, "list \(dir): the server repeated a page token (the listing loops)")
                }
                report(progress)
            } while token != nil
        }
    }

    private static func writeOrThrow(_ writer: ManifestWriter, _ item: ObjectMetadata) throws(StorageError) {
        do throws(ManifestError) {
            try writer.write(item)
        } catch {
            throw StorageError(.invalidArgument, error.message)
        }
    }
}
