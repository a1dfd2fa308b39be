import Foundation
import XCTest
@testable import LlamaANE

/// A Gemma 4 export's manifest holds Gemma 4's own config fields (docs/manifest.md); this host runs
/// none of its per-layer inputs, so it refuses such a manifest by the field's name.
final class Gemma4ManifestTests: XCTestCase {
    func testAGemma4ManifestIsRefusedByItsConfigFieldsName() throws {
        let url = try Fixtures.url("export_gemma3").appendingPathComponent(Manifest.fileName)
        var object = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        var config = try XCTUnwrap(object["config"] as? [String: Any])
        config["model_type"] = "gemma4_text"
        config["value_norm"] = true  // as llama-ane writes a Gemma 4 export's config
        config["layer_scalar"] = true
        config["per_layer_input_size"] = 8
        config["per_layer_vocab_size"] = 320
        config["final_logit_softcapping"] = 30.0
        config["rope_proportion"] = 0.25
        object["config"] = config
        XCTAssertThrowsError(try Manifest.decode(JSONSerialization.data(withJSONObject: object))) { error in
            XCTAssertEqual(error as? ManifestError, .unknownConfigField("final_logit_softcapping"))
            XCTAssertTrue("\(error)".contains("config.final_logit_softcapping"), "\(error)")
        }
    }
}
