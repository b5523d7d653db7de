import Foundation
import Glibc
import Testing
@testable import StorageClient

/// What https trusts and what a failed TLS set-up says (docs/security.md, "TLS"). The real
/// certificates (a throwaway CA, expired and wrong-host certificates) are in
/// Tests/integration/test_tls.py; these pin the mapping and the store's loading.
@Suite struct TLSTests {
    static let origin = "https://127.0.0.1:8443"

    @Test(arguments: [
        (TLSFailure.unableToGetIssuerLocally, "is not signed by a CA storefs trusts"),
        (TLSFailure.selfSignedLeaf, "is not signed by a CA storefs trusts"),
        (TLSFailure.selfSignedInChain, "is not signed by a CA storefs trusts"),
        (TLSFailure.expired, "has expired"),
        (TLSFailure.notYetValid, "is not valid yet"),
        (TLSFailure.curlHostCheck, "does not name 127.0.0.1"),
        (TLSFailure.hostMismatch, "does not name 127.0.0.1"),
    ])
    func eachCertificateProblemIsNamedWithWhatToDo(verifyResult: Int, phrase: String) throws {
        let e = try #require(TLSFailure.error(.verification(verifyResult: verifyResult), detail: "SSL detail", origin: Self.origin))
        #expect(e.code == .tlsFailure)
        #expect(e.message.contains(phrase))
        #expect(e.message.contains(Self.origin) && e.message.contains("(SSL detail)"))
        #expect(!e.message.contains("\n"))
    }

    @Test func anUnknownIssuerPointsAtCaFile() throws {
        let e = try #require(TLSFailure.error(.verification(verifyResult: TLSFailure.unableToGetIssuerLocally), detail: "", origin: Self.origin))
        #expect(e.message.contains("ca_file=") && e.message.contains("update-ca-certificates"))
    }

    @Test(arguments: ["OpenSSL SSL_connect: Connection reset by peer in connection to 127.0.0.1:8443",
                      "OpenSSL SSL_connect: SSL_ERROR_SYSCALL: unexpected eof while reading"])
    func aHandshakeCutShortIsATransferFaultNotATLSFailure(detail: String) {
        #expect(TLSFailure.error(.handshake, detail: detail, origin: Self.origin) == nil)
    }

    @Test func aHandshakeWithNoCommonGroundIsFinal() throws {
        let e = try #require(TLSFailure.error(.handshake, detail: "error:0A00010B:SSL routines::wrong version number", origin: Self.origin))
        #expect(e.code == .tlsFailure && e.message.contains("TLS handshake with \(Self.origin) failed"))
    }

    @Test func tlsFailuresAreNeverRetried() {
        #expect(!RetryPolicy().isRetryable(StorageError(.tlsFailure, "x")))
    }

    // MARK: the store

    func temporaryFile(_ contents: String) -> String {
        let path = NSTemporaryDirectory() + "storefs-tls-\(UUID().uuidString).pem"
        _ = FileManager.default.createFile(atPath: path, contents: Data(contents.utf8))
        return path
    }

    @Test func theSystemBundleLoadsWithEveryCertificate() throws {
        let store = try TrustStore.load(file: "/etc/ssl/certs/ca-certificates.crt", named: "ca_file=system")
        let count = try #require(store.summary.split(separator: "(").last?.split(separator: " ").first.flatMap { Int($0) })
        #expect(count > 50)
    }

    @Test func aMissingFileSaysSoInOneLine() {
        #expect { _ = try TrustStore.load(file: "/nonexistent/ca.pem", named: "ca_file=/nonexistent/ca.pem") } throws: {
            let e = $0 as? StorageError
            return e?.code == .invalidArgument && e?.message == "ca_file=/nonexistent/ca.pem: cannot read it (No such file or directory): give a PEM file of the CA certificates to trust"
        }
    }

    @Test func aDirectoryIsNotAFile() {
        #expect { _ = try TrustStore.load(file: "/etc/ssl/certs", named: "ca_file=/etc/ssl/certs") } throws: {
            ($0 as? StorageError)?.message.contains("is not a regular file") == true
        }
    }

    @Test(arguments: ["", "not a certificate at all\n", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"])
    func aFileWithoutCertificatesIsRefused(contents: String) {
        let path = temporaryFile(contents)
        defer { unlink(path) }
        #expect { _ = try TrustStore.load(file: path, named: "ca_file=\(path)") } throws: {
            ($0 as? StorageError)?.message == "ca_file=\(path) holds no PEM certificate (-----BEGIN CERTIFICATE-----): give the CA's certificate in PEM form"
        }
    }

    @Test func aBrokenCertificateIsRefusedNotHalfLoaded() throws {
        let system = try String(contentsOfFile: "/etc/ssl/certs/ca-certificates.crt", encoding: .utf8)
        let first = try #require(system.range(of: "-----END CERTIFICATE-----"))
        let broken = String(system[..<first.upperBound]) + "\n-----BEGIN CERTIFICATE-----\n!!!!not base64!!!!\n-----END CERTIFICATE-----\n"
        let path = temporaryFile(broken)
        defer { unlink(path) }
        #expect { _ = try TrustStore.load(file: path, named: "ca_file=\(path)") } throws: {
            ($0 as? StorageError)?.message.contains("cannot be parsed") == true
        }
    }

    @Test func caFileWinsOverTheEnvironmentWhichWinsOverTheSystemStore() throws {
        let bundle = "/etc/ssl/certs/ca-certificates.crt"
        #expect(try TrustStore.chosen(caFile: nil, environment: [:]) == nil)
        #expect(try TrustStore.chosen(caFile: nil, environment: ["SSL_CERT_FILE": bundle])?.summary.hasPrefix("SSL_CERT_FILE=") == true)
        #expect(try TrustStore.chosen(caFile: nil, environment: ["SSL_CERT_FILE": "/none", "CURL_CA_BUNDLE": bundle])?
            .summary.hasPrefix("CURL_CA_BUNDLE=") == true)
        #expect(try TrustStore.chosen(caFile: bundle, environment: ["CURL_CA_BUNDLE": "/none"])?.summary.hasPrefix("ca_file=") == true)
        #expect { _ = try TrustStore.chosen(caFile: nil, environment: ["CURL_CA_BUNDLE": "/none"]) } throws: {
            ($0 as? StorageError)?.message.hasPrefix("CURL_CA_BUNDLE=/none (from the environment): cannot read it") == true
        }
    }

    // MARK: against a socket

    @Test func httpsToAPlainServerFailsOnceWithTheHandshakeNamed() throws {
        // A plain HTTP server answers the ClientHello with an HTTP error, as Go's does.
        let server = PlainAnswerServer(answer: "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        defer { server.stop() }
        let http = HTTPClient(userAgent: "test")
        let url = "https://127.0.0.1:\(server.port)/o"
        #expect { _ = try RetryPolicy().run { t throws(StorageError) in try http.get(url, headers: [], deadline: t.deadline) } } throws: {
            let e = $0 as? StorageError
            return e?.code == .tlsFailure && e?.message.contains("TLS handshake with https://127.0.0.1:\(server.port) failed") == true
        }
        #expect(server.connections == 1)  // never retried
    }
}

/// Answers each connection's first bytes, whatever they are, with `answer`, then closes it.
final class PlainAnswerServer: @unchecked Sendable {
    let port: UInt16
    private let listener: Int32
    private let lock = NSLock()
    private var accepted = 0

    init(answer: String) {
        let (fd, port) = RawHTTPServer.listenOnLoopback()
        listener = fd
        self.port = port
        Thread { [self] in
            while true {
                let c = accept(fd, nil, nil)
                if c < 0 { return }
                lock.lock(); accepted += 1; lock.unlock()
                var buf = [UInt8](repeating: 0, count: 4096)
                _ = recv(c, &buf, buf.count, 0)
                RawHTTPServer.send(c, answer)
                close(c)
            }
        }.start()
    }

    var connections: Int { lock.lock(); defer { lock.unlock() }; return accepted }

    func stop() {
        shutdown(listener, Int32(SHUT_RDWR))
        close(listener)
    }
}
